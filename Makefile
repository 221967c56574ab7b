# `make demo` runs the main job (`make demo-s3`: its preempted run with the
# checkpoints in a bucket of a local S3 server), `make test` the whole test suite
# (of the crash points, a seeded subset), `make test-crash` every crash point
# and the kill suites that sample at their full length,
# `make test-quick` its quick subset (1- and 2-process basics, no slow or fault
# tests), `make test-extended` the cases of a suite beside those make test
# runs, `make fuzz` the resume contract's fuzzer at length (FUZZ_EXAMPLES
# in-process examples, FUZZ_LAUNCHED batches of 2-process ones each for DDP and
# FSDP2), `make lint` ruff (configured in pyproject.toml), `make docs` the
# Sphinx site of docs/ into docs/_build/html, warnings as errors; each sets up its own
# virtual environment with the pinned dependencies first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-s3 test test-quick test-extended test-crash compat wheel release-check fuzz lint docs bench bench-s3 clean

$(STAMP): requirements-dev.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/resume_demo.py

demo-s3: $(STAMP)
	$(PY) examples/resume_demo.py --store s3 --out runs/demo-s3

test: $(STAMP)
	@echo "make test: about 27 minutes on 2 cores; at the start the fault suites print nothing for minutes"
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=10 -m "not crash and not extended and not release" tests

test-quick: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not faults and not release" tests

# the cases of a suite beside those make test runs (the data pipeline's
# other loader settings and processes)
test-extended: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m extended tests

# the support matrix's oldest and newest combinations (noxfile.py), each
# installed in a virtual environment of its own, running the quick subset
# (nox -s compat: every combination)
compat: $(STAMP)
	$(PY) -m nox -s "compat(stack='oldest')" "compat(stack='newest')"

# the release files (sdist and wheel) into dist/, checked by twine
wheel: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m twine check --strict dist/*

# the release, built and installed into a fresh virtual environment, running
# the quick start there (plain and with [s3]): tests/project/test_release.py
release-check: $(STAMP)
	$(PY) -m pytest -m release tests/project/test_release.py

# every crash point of a local save (1 and 2 processes) and of an upload,
# killed and relaunched (tests/faults/test_crash_points.py; make test runs a
# seeded subset); the three enumerations spread over the two workers, each
# test under two hours (setup.cfg bounds one to 15 min, too few at length)
test-crash: $(STAMP)
	FAULTS_AT_LENGTH=1 $(PY) -m pytest -n 2 --dist load --timeout 7200 -m crash tests/faults/test_crash_points.py
	FAULTS_AT_LENGTH=1 $(PY) -m pytest -n 2 --dist loadfile --timeout 7200 tests/faults/test_random_kills.py tests/faults/test_mid_epoch_kills.py

# 500 examples in 1 process and 56 in 2 (28 DDP, 28 FSDP2), seeded: the same
# every run; torch.compile drawn too (make test's seeded subset leaves it out);
# one test runs them all, for hours: a bound of its own (setup.cfg's is 15 min)
FUZZ_EXAMPLES ?= 500
FUZZ_LAUNCHED ?= 14
fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_LAUNCHED=$(FUZZ_LAUNCHED) FUZZ_BATCH=2 FUZZ_COMPILE=1 \
		$(PY) -m pytest -n 2 --dist load --timeout 14400 tests/callbacks/test_contract_fuzz.py

lint: $(STAMP)
	$(PY) -m ruff check .

# -n: every cross-reference must resolve; --keep-going: all warnings at once
docs: $(STAMP)
	$(PY) -m sphinx -b html -W --keep-going -n -q docs docs/_build/html

bench: $(STAMP)
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_peers.py
	$(PY) benchmarks/bench_positions.py
	$(PY) benchmarks/bench_frozen.py
	$(PY) benchmarks/bench_mid_epoch.py
	$(PY) benchmarks/bench_resume.py

bench-s3: $(STAMP)
	$(PY) benchmarks/bench_remote.py
	$(PY) benchmarks/bench_resume.py --remote --sizes 25e6,50e6

clean:
	rm -rf $(VENV) runs docs/_build docs/_generated

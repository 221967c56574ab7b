"""The resume contract, fuzzed (issue 28): Hypothesis draws a net, skorch's
callbacks and a user callback with per-rank state, a schedule of saves, a
script of fit calls, an interruption and a change between launches; the
oracle (tests/support/contract_fuzz.py) checks the relaunch against the
uninterrupted run on every rank.

- test_one_process_contract: in this process (each "launch" a fresh net
  and Accelerator, the global generators seeded as a script seeds them);
  interruptions: SIGTERM, SIGINT, an exception raised by a callback;
- test_ddp_contract, test_fsdp2_contract: launched in 2 processes (DDP;
  FSDP2 forced on CPU as tests/workers/fsdp_backend.py does), a batch of
  examples per Hypothesis example so that the launches are shared; also
  SIGKILL at a step and inside a save, and 2 -> 1 processes with
  ``on_world_size_change='reseed'`` (DDP).

Bounds, from the environment (``make test``: the defaults; ``make fuzz``:
``FUZZ_EXAMPLES=500 FUZZ_LAUNCHED=14 FUZZ_BATCH=2 FUZZ_COMPILE=1``):
FUZZ_EXAMPLES (25)
in-process examples, FUZZ_LAUNCHED (2) launched batches of FUZZ_BATCH (1)
examples for each of DDP and FSDP2, FUZZ_COMPILE=1 drawing torch.compile
too. The runs are derandomized (the same examples every run);
FUZZ_SEED draws others. FUZZ_INTERRUPTS, FUZZ_CHANGES and FUZZ_SCRIPTS
(comma-separated kinds) focus a run on some kinds; FUZZ_CALLBACKS
(comma-separated kinds of callbacks) puts those callbacks into every
example (``FUZZ_CALLBACKS=freezer``: every run has a frozen base, whose
checkpoints link the frozen parameters' file). A failure prints its
shrunk configuration(s) and a command line that reruns them (:func:`replay`).

What it found on the code before issue 28's fixes (main at 78b9e19),
where these tests fail (shrunk examples in the fuzz helper's report):

- 1, per-rank state: in 2 processes (DDP and FSDP2) rank 1 ends with rank
  0's history and callback states (``differs_history`` on rank 1);
- 2, FSDP2 with BatchNorm1d: ``running_mean`` differs on rank 0 after the
  resume (``differs_params``);
- 3, a callback setting changed between launches is not refused (found
  with the user callback's ``scale``, drawn to change again now that every
  callback's settings are recorded: ``callbacks__<name>__scale`` not
  refused; skorch's callbacks' settings are drawn to change too);
- 4, ``check_params=('lr',)`` with a scheduler: its ``base_lrs`` keep the
  checkpoint's lr. Found by itself with the change kind ``scheduled_lr``
  (``FUZZ_CHANGES=scheduled_lr FUZZ_SCRIPTS=fit FUZZ_EXAMPLES=8``, 1
  process), shrunk to LambdaLR, lr 0.05 -> 0.2, no interruption, 2 epochs:
  "check_params let lr=0.2 through, but the scheduler's base_lrs are
  [0.05]" (``check_in_force``);
- 5, two unnamed EarlyStoppings reordered: not refused;
- 6, a script of two fit calls (``warm_start=True``, or fit then
  partial_fit) relaunched after it finished, or after an interruption in
  its second call, ends with other parameters (epochs trained again) or
  crashes (``TypeError`` in load_state);
- 7, a batch-size refusal of a checkpoint inside an epoch advises an
  epoch's end checkpoint where the folder (keep_last, every_n_steps) has none;
- 8, ``load_params(checkpoint=...)`` with the newest checkpoint's model
  file damaged warns twice (``check_load_params``): found in both focused
  runs above and in ``FUZZ_CHANGES=none FUZZ_INTERRUPTS=crash
  FUZZ_SCRIPTS=fit+partial_fit,warm_start FUZZ_EXAMPLES=10``, shrunk to
  "load_params warned 2 times about the damaged .../B/epoch-0006:
  ['skipping checkpoint ...: model.safetensors has 2425 bytes, manifest.json
  says 2424: the file is damaged', the same again]" (fit then partial_fit,
  3 epochs each, a crash after batch 2, damage ``grown``);
  and in that last run (``check_retention``), a resumed checkpoint kept
  beyond keep_last after the later partial_fit, shrunk to fit then
  partial_fit of 3 epochs, keep_last=1, a crash after batch 16: "keep_last=1,
  but after the relaunch (resumed from epoch-0001) the folder keeps
  ['epoch-0001'] besides ['epoch-0006']" (with 6 there too: differs_params);
- beyond the issue: skorch's Freezer (found from a hand-written
  configuration, now tests/callbacks/test_fsdp.py's frozen test): under FSDP2 the
  relaunch crashed in torch.distributed.checkpoint's load (``Missing key
  in checkpoint state_dict: optimizer.state.lin.bias.momentum_buffer``);
  in 1 process and DDP a relaunch after the Freezer's epoch trained the
  frozen parameters (``differs_params``), since whether a parameter
  trains was not part of a checkpoint.
"""

import json
import os
import signal
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, note, seed, settings, strategies as st

from contract_fuzz import (
    OTHER_KINDS,
    check_batch,
    check_example,
    configs,
    in_last_call,
    reproduction,
    run_in_process,
    run_launched,
    temp_folder,
)

EXAMPLES = int(os.environ.get('FUZZ_EXAMPLES', '25'))
# Hypothesis tries the simplest example first (no callbacks, no interruption,
# no change): the second launched example is the first drawn at random
LAUNCHED = int(os.environ.get('FUZZ_LAUNCHED', '2'))
BATCH = int(os.environ.get('FUZZ_BATCH', '1'))
# an in-process example past this many seconds is a hang
IN_PROCESS_DEADLINE = int(os.environ.get('FUZZ_DEADLINE', '180'))


def named(variable, every):
    """The names of ``every`` that the environment's ``variable`` lists
    (comma-separated), in its order; none where it is unset."""
    names = [name for name in os.environ.get(variable, '').replace(' ', '').split(',') if name]
    unknown = set(names) - set(every)
    if unknown:
        raise ValueError(f"{variable}: unknown {sorted(unknown)}, choose from {every}")
    return tuple(names)


def chosen(variable, default, every):
    """Those of ``default`` a focused run chose (comma-separated names
    of ``every``), else all of ``default``."""
    names = named(variable, every)
    if not names:
        return default
    return tuple(name for name in default if name in names) or ('none',)


INTERRUPTS = ('none', 'sigterm', 'crash', 'sigint', 'sigkill', 'sigkill_in_save')
# scheduled_lr: a new lr that check_params lets through, with an LR scheduler;
# accelerator: another gradient accumulation or mixed precision; clone: the
# relaunch's net a clone whose folder set_params set
CHANGES = ('none', 'net', 'scheduled_lr', 'callback', 'reorder', 'accelerator', 'clone',
           'world_size')
# torch.compile costs seconds a launch: drawn where FUZZ_COMPILE=1 (make fuzz)
COMPILE_MODES = (False, True) if os.environ.get('FUZZ_COMPILE') == '1' else (False,)


# SIGKILLs only where a launch can die of them
ONE_PROCESS_INTERRUPTS = chosen('FUZZ_INTERRUPTS', INTERRUPTS[:4], INTERRUPTS)
LAUNCHED_INTERRUPTS = chosen('FUZZ_INTERRUPTS', INTERRUPTS, INTERRUPTS)
# another number of processes: from 2 DDP processes to 1
ONE_PROCESS_CHANGES = chosen('FUZZ_CHANGES', CHANGES[:-1], CHANGES)
DDP_CHANGES = chosen('FUZZ_CHANGES', CHANGES, CHANGES)
# the forced FSDP2 back-end's Accelerator has no settings drawn
FSDP2_CHANGES = chosen('FUZZ_CHANGES', tuple(c for c in CHANGES[:-1] if c != 'accelerator'),
                       CHANGES)
SCRIPTS = chosen('FUZZ_SCRIPTS', ('fit', 'fit+partial_fit', 'warm_start'),
                 ('fit', 'fit+partial_fit', 'warm_start'))
REQUIRED_CALLBACKS = named('FUZZ_CALLBACKS', OTHER_KINDS)


def bounded(max_examples):
    """Hypothesis settings of a bounded, seeded run."""
    derandomize = 'FUZZ_SEED' not in os.environ
    chosen = settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                      database=None, print_blob=True,
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.data_too_large])

    def decorate(test):
        test = chosen(test)
        return test if derandomize else seed(int(os.environ['FUZZ_SEED']))(test)
    return decorate


@contextmanager
def deadline(seconds):
    """Fail an in-process example that runs past ``seconds`` (a hang)."""
    def expired(signum, frame):
        raise TimeoutError(f"the example ran past {seconds} s: a hang")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_one_process(config):
    """Run and check one in-process example; its results."""
    with temp_folder() as where, deadline(IN_PROCESS_DEADLINE):
        results = run_in_process(config, where)
        check_example(config, results)
        return results


def check_launched(batch):
    with temp_folder() as where:
        results, launches = run_launched(batch, where)
        # every 2-process run that got going ran 2 processes (an error's
        # outcome is the oracle's to report)
        counts = [o['num_processes'] for result in results
                  for o in result.get('reference') or [] if o and 'num_processes' in o]
        assert all(count == 2 for count in counts), counts
        check_batch(batch, results, launches)
        return results


@pytest.mark.slow
@bounded(EXAMPLES)
@given(config=configs(interrupts=ONE_PROCESS_INTERRUPTS, change_kinds=ONE_PROCESS_CHANGES,
                      scripts=SCRIPTS, compile_modes=COMPILE_MODES,
                      required_callbacks=REQUIRED_CALLBACKS))
def test_one_process_contract(config):
    note(reproduction(config))
    check_one_process(config)


@pytest.mark.slow
@bounded(LAUNCHED)
@given(batch=st.lists(configs(nproc=2, backend='ddp', interrupts=LAUNCHED_INTERRUPTS,
                              change_kinds=DDP_CHANGES, scripts=SCRIPTS,
                              compile_modes=COMPILE_MODES,
                              required_callbacks=REQUIRED_CALLBACKS),
                      min_size=BATCH, max_size=BATCH))
def test_ddp_contract(batch):
    note(reproduction(batch))
    check_launched(batch)


@pytest.mark.slow
@bounded(LAUNCHED)
@given(batch=st.lists(configs(nproc=2, backend='fsdp2', interrupts=LAUNCHED_INTERRUPTS,
                              change_kinds=FSDP2_CHANGES, scripts=SCRIPTS,
                              required_callbacks=REQUIRED_CALLBACKS),
                      min_size=BATCH, max_size=BATCH))
def test_fsdp2_contract(batch):
    note(reproduction(batch))
    check_launched(batch)


# the examples that found the data pipeline's divergences on the code before
# they were fixed (every one differs_params there), shrunk: a SIGTERM inside
# epoch 3 saves there (or a crash ends the run), the relaunch goes on
DATA_EXAMPLE = {
    'backend': 'none', 'batch_size': 8, 'batchnorm': True,
    'callbacks': [{'kind': 'tally', 'name': 'tally', 'params': {'scale': 1.0}}],
    'change': {'kind': 'none'}, 'damage': 'none', 'dropout': 0.2, 'hidden': 16,
    'interrupt': {'batch': 19, 'kind': 'sigterm', 'who': 'all'}, 'lr': 0.05,
    'max_epochs': 4, 'momentum': 0.9, 'nproc': 1, 'rows': 115,
    'saves': {'async_save': False, 'every_n_epochs': 1, 'every_n_steps': None, 'keep_last': 3},
    'script': 'fit', 'valid': False,
}
DATA_EXAMPLES = [
    ({'num_workers': 2, 'persistent_workers': True}, 'sigterm'),
    ({'num_workers': 2, 'augment': 'torch'}, 'sigterm'),
    ({'num_workers': 0, 'augment': 'numpy'}, 'sigterm'),
    ({'num_workers': 0, 'generator': 7}, 'sigterm'),
    ({'num_workers': 2, 'augment': 'python', 'generator': 3}, 'crash'),
]


@pytest.mark.parametrize('data, interrupt', DATA_EXAMPLES,
                         ids=[json.dumps(data) + '-' + kind for data, kind in DATA_EXAMPLES])
def test_data_pipeline_examples(data, interrupt):
    config = dict(DATA_EXAMPLE, data=data,
                  interrupt=dict(DATA_EXAMPLE['interrupt'], kind=interrupt))
    check_one_process(config)


# every interruption kind, each inside an epoch and checked bit for bit
# against the uninterrupted run, with the settings the draws may miss in a
# short run: Adam, gradient accumulation, bf16, a clone's relaunch
INTERRUPTED = dict(DATA_EXAMPLE, batchnorm=False, data={'num_workers': 0},
                   saves=dict(DATA_EXAMPLE['saves'], every_n_steps=3))
ONE_PROCESS_INTERRUPTED = {
    'sigterm-adam-accumulation-bf16': dict(
        INTERRUPTED, optimizer='adam',
        accelerator={'gradient_accumulation_steps': 2, 'mixed_precision': 'bf16'}),
    'sigint': dict(INTERRUPTED, interrupt=dict(INTERRUPTED['interrupt'], kind='sigint')),
    'crash-clone': dict(INTERRUPTED, interrupt=dict(INTERRUPTED['interrupt'], kind='crash'),
                        change={'kind': 'clone'}),
}
# 2 processes: 8 batches a rank and epoch; batch 11 is the third of epoch 2;
# in a script of two fit calls of 4 epochs each, batch 43 is the third of
# epoch 6, in the second call (after the step checkpoint of batch 42), and
# batch 35 the third of epoch 5, the second call's first
LAUNCHED_INTERRUPTED = {
    'sigkill': dict(INTERRUPTED, nproc=2, backend='ddp', damage='none', optimizer='adam',
                    interrupt={'batch': 11, 'kind': 'sigkill', 'who': 'all'}),
    'sigkill-partial_fit': dict(INTERRUPTED, nproc=2, backend='ddp', damage='none',
                                script='fit+partial_fit',
                                interrupt={'batch': 43, 'kind': 'sigkill', 'who': 'all'}),
    'sigkill_in_save': dict(INTERRUPTED, nproc=2, backend='ddp', damage='none',
                            interrupt={'batch': 11, 'kind': 'sigkill_in_save', 'who': 'all'}),
    'sigterm-rank0-warm_start': dict(INTERRUPTED, nproc=2, backend='ddp', damage='none',
                                     accelerator={'gradient_accumulation_steps': 2},
                                     script='warm_start',
                                     interrupt={'batch': 35, 'kind': 'sigterm',
                                                'who': 'rank0'}),
}


@pytest.mark.parametrize('name', ONE_PROCESS_INTERRUPTED)
def test_every_interruption_resumes_exactly_in_one_process(name):
    results = check_one_process(ONE_PROCESS_INTERRUPTED[name])
    # it fired, and the relaunch resumed inside the epoch it stopped in
    assert results['first']['outcomes'][0]['fired']
    assert results['facts']['newest_inside'], results['facts']


@pytest.mark.slow
def test_every_interruption_resumes_exactly_in_two_processes():
    batch = list(LAUNCHED_INTERRUPTED.values())
    results = check_launched(batch)
    for name, result in zip(LAUNCHED_INTERRUPTED, results, strict=True):
        first = result['first']
        if name.startswith('sigkill'):
            # check_sigkill: the SIGKILL was sent, and killed the rank sending
            # it; the relaunch resumed inside the epoch, from step 9
            assert any(first['killed']), (name, first['killed'])
            assert result['facts']['newest_inside'], (name, result['facts'])
        else:
            # where the ranks agree on the signal (every 0.5 s) decides
            # whether its save is inside an epoch
            assert first['outcomes'][0]['fired'], name
        config, facts = LAUNCHED_INTERRUPTED[name], result['facts']
        if config['script'] != 'fit':
            # it struck in the script's second fit call
            newest = facts['manifests'][facts['committed'][-1]]
            assert in_last_call(config, newest), (name, facts)


def replay(drawn):
    """Rerun the configuration (a dict) or launched batch (a list) that a
    failure printed, without Hypothesis (whose note() needs a test)."""
    if isinstance(drawn, dict):
        check_one_process(drawn)
    else:
        check_launched(drawn)


if __name__ == '__main__':
    # the command line a failure prints (contract_fuzz.reproduction)
    replay(json.loads(os.environ['CONTRACT_CONFIG']))

"""SIGKILL at every file-system call of a save, its commit and a retirement,
and at every request of an upload: enumerated, not sampled (issue 30).

One uninterrupted launch of the fault job (tests/faults/workers/faultjob.py:
3 epochs, ``keep_last=1``, so that the commit of epoch 2 retires epoch 1)
runs under ``strace -f -y``; every call that changes the checkpoint folder
(create, write, fsync, rename, unlink, mkdir, rmdir, chmod, truncate) from
the first that names ``epoch-0002`` up to the first that names
``epoch-0003``, and every removal inside the retired ``epoch-0001``, is a
crash point (tests/faults/crashpoints.py). For each, a launch of the same
job runs under ``strace -P PATH -e inject=SYSCALL:signal=SIGKILL:when=K``
and dies on entering that call; the test then asserts that

- the kill fired there: the rank died of SIGKILL, and strace's log shows
  that very call (syscall and paths) entered and never returned;
- nothing committed is lost: ``latest.json`` names a complete checkpoint,
  the newest one committed before the call (``epoch-0002`` once the rename
  of ``latest.json`` naming it is done, else ``epoch-0001``);
- a relaunch without strace resumes from exactly that checkpoint, on every
  rank, and ends bit-identical to an uninterrupted launch (parameters,
  optimizer state, losses), with no partial folder left.

Uploads (into a bucket of the local S3 server; 1 and 2 processes, rank 0
uploading every rank's files in both): the job reaches
the store through a proxy (``s3server.Proxy``) that counts its requests
from the commit of epoch 1 on; every request up to the first that names
``epoch-0003`` (the files of ``epoch-0002``, the lease, its manifest, the
pointer, the listing and removals that retire ``epoch-0001``) is a crash
point: the proxy SIGKILLs the job once the store has answered that request,
before the job sees the answer. The checkpoint committed by then must be
in the store intact; the relaunch must resume from it, or from the newer
one of the staging folder whose upload it finishes, and end bit-identical
with no unfinished upload and no checkpoint without a manifest left.

A relaunch on a new machine (1 process; a copy of a run whose job was
killed once epoch 2 was committed, under a URL of its own, so an empty
staging folder): every request from its first up to the first that names
``epoch-0003`` (the reachability check and the lease, the choice, the
download of epoch 2 into the staging folder) is a crash point, each
request counted among those alike. After the kill the store must still
hold epoch 2 complete; a relaunch on the same machine must resume from it,
end bit-identical and leave no unfinished upload and no partial download
behind.

In 2 processes the points of each rank's process are enumerated (rank 0
commits; rank 1 writes its own files). The launches go through a fork
server (tests/faults/workers/zygote.py) that imported torch once: each
costs seconds instead of tens of seconds on 2 busy cores; the traced
uninterrupted launch is checked bit-identical to a real launch
(tests/support/launcher.py), so forking changes nothing the test compares.

``make test`` runs a seeded subset (in 1 process one point of each syscall
kind, in 2 one point of each rank, 3 requests of the upload in 1 process
and 1 in 2, 3 requests of the relaunch; with a frozen base the links, and
of its uploads one request of each method naming the shared folder and the
manifests);
``make test-crash`` (marker ``crash``) every point.
"""

import os
import random
import tempfile
import uuid

import pytest

from crashpoints import (
    MUTATING,
    KillAtNth,
    KillAtRequest,
    kinds,
    parse,
    plan,
    request_what,
    require_strace,
    upload_points,
)
from faultsuite import expected_resume, leftovers, pointed, run_job
from skorch_accel_callbacks.format import PARTIAL_SUFFIX
from skorch_accel_callbacks.storage._remote import RemoteStorage
from testutil import assert_identical, final_state, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SUBSET_SEED = 30
# the job of tests/faults/workers/killable.py with its first layer frozen
# after the first step: the optimizer holds that layer's momentum, and each
# save after the first links both frozen parts, the model's and the
# optimizer's
FROZEN = {'FROZEN_BASE': 'trained'}
FROZEN_PARTS = ('model_frozen.safetensors', 'optimizer_frozen.bin')


def test_a_machine_without_strace_fails_the_suite_saying_so(monkeypatch):
    import crashpoints
    monkeypatch.setattr(crashpoints, 'STRACE', None)
    with pytest.raises(AssertionError, match='needs strace .*apt-get install strace'):
        crashpoints.require_strace()


def test_the_log_parse_keeps_a_resumed_call_to_its_own_arguments():
    """A call another thread interrupts in the log ends on a line of its
    own, which strace pads up to the result's column; the result of an
    openat names the file opened again, and must not count as a path of the
    call (it made the plan's openat of the optimizer file name it twice,
    once the early flush's thread ran beside it). Lines of strace 6.1."""
    log = (
        '14835 openat(AT_FDCWD</w>, "/c/epoch-0002.partial/optimizer.bin", '
        'O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666 <unfinished ...>\n'
        '14950 fdatasync(8</c/epoch-0002.partial/model.safetensors>) = 0\n'
        '14835 <... openat resumed>)             = 9</c/epoch-0002.partial/optimizer.bin>\n'
        '14835 close(9</c/epoch-0002.partial/optimizer.bin>)  = 0\n'
        '14835 rmdir("/c/.epoch-0001.discard-1846d424c17c") = ?\n')
    opened, flushed, closed, removed = parse(log)
    assert (opened.tid, opened.name, opened.killed) == (14835, 'openat', False)
    assert opened.paths == ['/c/epoch-0002.partial/optimizer.bin']
    assert flushed.paths == ['/c/epoch-0002.partial/model.safetensors']
    assert closed.paths == ['/c/epoch-0002.partial/optimizer.bin']
    assert (removed.paths, removed.killed) == (['/c/.epoch-0001.discard-1846d424c17c'], True)


@pytest.fixture(scope='module', autouse=True)
def strace():
    """Every crash point is injected by strace: without it the suite fails,
    saying how to install it."""
    require_strace()


def traced_run(zygote, folder, nproc, reference, **env):
    """The plan of each rank: crash points from an uninterrupted traced launch."""
    root = folder / 'ckpt'
    options = {rank: ['-f', '-qq', '-y', '-e', 'signal=none', '-o', str(folder / f'trace{rank}'),
                      '-e', 'trace=' + ','.join(MUTATING)] for rank in range(nproc)}
    zygote.launch('killable.py', folder, root, 'dry', nproc=nproc, strace=options,
                  **env).check()
    # the fork server and strace change nothing that the test compares
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'dry'))
    return {rank: plan((folder / f'trace{rank}').read_text(), str(root))
            for rank in range(nproc)}


@pytest.fixture(scope='module')
def one_process(zygote, tmp_path_factory):
    """The 1-process reference (a real launch) and the plan of its save."""
    folder = tmp_path_factory.mktemp('crash-1proc')
    run_job('killable.py', folder, folder / 'ref-ckpt', 'ref', nproc=1).check()
    return folder, traced_run(zygote, folder, 1, folder)


@pytest.fixture(scope='module')
def frozen_base(zygote, tmp_path_factory):
    """The 1-process reference and plan of the job whose first layer is
    frozen after its first step: the save of epoch 2 links epoch 1's frozen
    parts, then its commit retires epoch 1."""
    folder = tmp_path_factory.mktemp('crash-frozen')
    run_job('killable.py', folder, folder / 'ref-ckpt', 'ref', nproc=1, **FROZEN).check()
    return folder, traced_run(zygote, folder, 1, folder, **FROZEN)


@pytest.fixture(scope='module')
def two_processes(zygote, reference, tmp_path_factory):
    """The plans of both ranks' processes in 2 processes."""
    folder = tmp_path_factory.mktemp('crash-2proc')
    return reference, traced_run(zygote, folder, 2, reference)


def kill_at(zygote, point, folder, nproc, rank, env):
    """Launch the job with rank ``rank`` killed at ``point``: the folder of
    the launch that died exactly there, and the number of launches it took.

    A point counted among all calls of its kind in the main thread (a
    safetensors temporary file) may be a few calls off where a module loads
    lazily in one launch and not another, or gloo writes to its sockets
    from that thread: a launch that killed too late shows the call's
    number in its log, the next launch uses it; one that killed too early
    tries the next number. The kill must still land on that very call (the
    same call of the log, counted as in the plan)."""
    tries = 1 if point.path is not None else 8
    when = point.when
    where = f"crash point {point.number} of rank {rank} in {nproc} process(es): {point.what}"
    for attempt_no in range(1, tries + 1):
        attempt = folder / f'try{attempt_no}'
        attempt.mkdir()
        ckpt, trace = attempt / 'ckpt', attempt / 'kill.trace'
        result = zygote.launch('killable.py', attempt, ckpt, 'killed', nproc=nproc, strace={
            rank: point.strace_options(str(ckpt), trace, when)}, **env)
        assert not result.timed_out, f"{where}: hung\n{result.report()}"
        landed, number = point.landed(parse(trace.read_text()), str(ckpt))
        if result.returncodes[rank] == -9 and landed:
            return attempt, attempt_no
        when = number or when + 1
    raise AssertionError(f"{where}: the kill did not fire there\n"
                         f"{trace.read_text()[-3000:]}\n{result.report()}")


def crash_at(zygote, point, folder, reference, nproc, rank, env):
    """Kill rank ``rank`` at ``point``, relaunch, check that nothing is lost;
    the number of launches the kill took."""
    folder, tries = kill_at(zygote, point, folder, nproc, rank, env)
    ckpt = folder / 'ckpt'
    where = f"crash point {point.number} of rank {rank} in {nproc} process(es): {point.what}"
    expected = str(ckpt / point.committed)
    assert pointed(ckpt) == expected, f"{where}: a committed checkpoint was lost"
    relaunch = zygote.launch('killable.py', folder, ckpt, 'relaunch', nproc=nproc, grace=10.0,
                             **env)
    relaunch.check()
    for other in range(nproc):
        resumed = read_json(folder / f'resumed-relaunch-rank{other}.json')
        assert (resumed['loaded_from'], resumed['num_processes']) == (expected, nproc), where
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'relaunch'))
    assert not [name for name in os.listdir(ckpt) if name.endswith(PARTIAL_SUFFIX)], where
    return tries


def subset(points):
    """One point of each syscall kind, drawn with a fixed seed."""
    rng = random.Random(SUBSET_SEED)
    return [rng.choice([point for point in points if point.call.name == name])
            for name in sorted(kinds(points))]


def one_point(points):
    """One point, drawn with a fixed seed (the kinds are covered in 1 process)."""
    return [random.Random(SUBSET_SEED).choice(points)]


def enumerate_points(zygote, plans, reference, nproc, tmp_path, pick, env=None):
    counts, retried = {}, 0
    for rank, points in plans.items():
        chosen = pick(points)
        for point in chosen:
            folder = tmp_path / f'rank{rank}-point{point.number}'
            folder.mkdir()
            retried += crash_at(zygote, point, folder, reference, nproc, rank, env or {}) > 1
        counts[rank] = (len(chosen), len(points))
    return counts, retried


def summary(nproc, counts, retried):
    ranks = ', '.join(f'rank {rank}: {done} of {total}'
                      for rank, (done, total) in counts.items())
    return (f'crash points, {nproc} process(es): {sum(c[0] for c in counts.values())} '
            f'file-system calls of a local save killed ({ranks}; {retried} at a neighbouring '
            'number); every relaunch bit-identical, no committed checkpoint lost')


def test_subset_of_the_crash_points_of_a_save_in_1_process(zygote, one_process, tmp_path,
                                                           record_property):
    reference, plans = one_process
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, subset)
    record_property('summary', summary(1, *counts) + ' (seeded subset)')


@pytest.mark.crash
def test_every_crash_point_of_a_save_in_1_process(zygote, one_process, tmp_path,
                                                  record_property):
    reference, plans = one_process
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, list)
    record_property('summary', summary(1, *counts) + f'; kinds {dict(kinds(plans[0]))}')


def links(points):
    """The points of the frozen save that link a committed part."""
    return [point for point in points if point.call.name in ('link', 'linkat')]


def test_the_crash_points_of_a_save_that_links_a_frozen_part(
        zygote, frozen_base, tmp_path, record_property):
    """The links of epoch 1's frozen parts (the model's and the
    optimizer's) are crash points of epoch 2's save (the plan holds them:
    the save links, it does not write the parts), killed there: nothing
    committed is lost, no checkpoint is left pointing at missing bytes (the
    relaunch resumes from the one committed, which retention of the other
    left whole). The save's other calls are of the kinds the subset of a
    plain save kills (make test-crash: every call of this one)."""
    reference, plans = frozen_base
    linking = links(plans[0])
    assert sorted(part for point in linking for part in FROZEN_PARTS
                  if part in ' '.join(point.call.paths)) == sorted(FROZEN_PARTS), \
        [p.what for p in plans[0]]
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, links, FROZEN)
    record_property('summary', summary(1, *counts) + ' (frozen base: the links)')


@pytest.mark.crash
def test_every_crash_point_of_a_save_that_links_a_frozen_part(zygote, frozen_base, tmp_path,
                                                              record_property):
    reference, plans = frozen_base
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, list, FROZEN)
    record_property('summary', summary(1, *counts) + ' (frozen base)')


def test_subset_of_the_crash_points_of_a_save_in_2_processes(zygote, two_processes, tmp_path,
                                                             record_property):
    reference, plans = two_processes
    counts = enumerate_points(zygote, plans, reference, 2, tmp_path, one_point)
    record_property('summary', summary(2, *counts) + ' (seeded subset)')


@pytest.mark.crash
def test_every_crash_point_of_a_save_in_2_processes(zygote, two_processes, tmp_path,
                                                    record_property):
    reference, plans = two_processes
    counts = enumerate_points(zygote, plans, reference, 2, tmp_path, list)
    record_property('summary', summary(2, *counts))


@pytest.fixture(scope='module')
def store(s3_endpoint, tmp_path_factory):
    """A bucket of the local S3 server that the test reaches directly and the
    job through a proxy that counts its requests; staging under a folder of
    the module's own."""
    import fsspec

    from s3server import S3_ENV, Proxy
    temp = tmp_path_factory.mktemp('tmp')
    with pytest.MonkeyPatch.context() as patch:
        for key, value in dict(S3_ENV, AWS_ENDPOINT_URL=s3_endpoint, TMPDIR=str(temp)).items():
            patch.setenv(key, value)
        patch.setattr(tempfile, 'tempdir', str(temp))
        bucket = f'crash-{uuid.uuid4().hex[:12]}'
        fsspec.filesystem('s3', skip_instance_cache=True).mkdir(bucket)
        proxy = Proxy(int(s3_endpoint.rsplit(':', 1)[1]))
        yield bucket, proxy
        proxy.cut()


def traced_upload(zygote, store, folder, nproc, reference, epoch=2, raw=False, **env):
    """The requests of the upload of checkpoint ``epoch``, from an
    uninterrupted launch through the proxy: the crash points of an upload
    in ``nproc`` process(es) (with ``raw``, and the request lines)."""
    bucket, proxy = store
    counter = KillAtRequest(folder / 'pid-dry-rank0', skip=epoch - 1)
    proxy.on_request = counter
    run = f'dry{nproc}-{folder.name}'
    try:
        zygote.launch('upload_killable.py', folder, f's3://{bucket}/{run}', 'dry',
                      nproc=nproc, AWS_ENDPOINT_URL=proxy.endpoint, **env).check()
    finally:
        proxy.on_request = None
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'dry'))
    points = upload_points(counter.counted, run, epoch)
    return (points, counter.counted) if raw else points


@pytest.fixture(scope='module')
def upload_plan(zygote, one_process, store, tmp_path_factory):
    """The crash points of an upload in 1 process."""
    return traced_upload(zygote, store, tmp_path_factory.mktemp('crash-upload'), 1,
                         one_process[0])


@pytest.fixture(scope='module')
def upload_plan_2(zygote, reference, store, tmp_path_factory):
    """The crash points of an upload in 2 processes: rank 0 uploads every
    rank's files (the staging folder is the machine's)."""
    return traced_upload(zygote, store, tmp_path_factory.mktemp('crash-upload-2proc'), 2,
                         reference)


def upload_crash_at(zygote, point, store, folder, reference, nproc, epoch=2, **env):
    """Kill the job (rank 0, the uploader) once the store did request
    ``point`` of the upload of checkpoint ``epoch``, relaunch, check."""
    (number, what, committed), (bucket, proxy) = point, store
    run = f'point{number}-{nproc}proc-{uuid.uuid4().hex[:8]}'
    url = f's3://{bucket}/{run}'
    name = f'epoch-{epoch:04d}'
    where = f"crash point {number} of an upload in {nproc} process(es): {what}"
    killer = KillAtRequest(folder / 'pid-killed-rank0', skip=epoch - 1, number=number)
    proxy.on_request = killer
    try:
        result = zygote.launch('upload_killable.py', folder, url, 'killed', nproc=nproc,
                               AWS_ENDPOINT_URL=proxy.endpoint, **env)
    finally:
        proxy.on_request = None
    assert killer.fired and result.returncodes[0] == -9, \
        f"{where}: did not fire\n{result.report()}"
    assert request_what(killer.fired, run, name) == what, (where, killer.fired)
    storage = RemoteStorage(url)
    if committed is not None:
        assert committed in storage.committed() and storage.check(committed)[1] is None, \
            f"{where}: committed {committed} lost: {storage.committed()}"
    expected, _ = expected_resume(url)
    # the relaunch may finish the cut upload, or that of the next checkpoint,
    # staged while the retirement after this one ran: never older than what
    # was committed
    newer = (name, f'epoch-{epoch + 1:04d}')
    assert expected in (committed and storage.url(committed), *map(storage.url, newer)), \
        (where, expected)
    zygote.launch('upload_killable.py', folder, url, 'relaunch', nproc=nproc, **env).check()
    for rank in range(nproc):
        outcome = read_json(folder / f'relaunch-rank{rank}.json')
        assert (outcome['error'], outcome['loaded_from'], outcome['num_processes']) == (
            None, expected, nproc), (where, rank, outcome)
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'relaunch'))
    assert RemoteStorage(url).committed()[-1] == 'epoch-0003', where
    assert leftovers(url) == [], where


def enumerate_requests(zygote, points, store, reference, tmp_path, nproc, epoch=2, **env):
    for point in points:
        folder = tmp_path / f'request{point[0]}'
        folder.mkdir(parents=True)
        upload_crash_at(zygote, point, store, folder, reference, nproc, epoch, **env)
    return len(points)


def test_subset_of_the_requests_of_an_upload(zygote, one_process, store, upload_plan,
                                             tmp_path, record_property):
    rng = random.Random(SUBSET_SEED)
    # a file, the pointer, a removal of the retired checkpoint
    chosen = [rng.choice([p for p in upload_plan if p[1].startswith(prefix)])
              for prefix in ('PUT epoch-0002/<file>', 'PUT latest.json', 'DELETE')]
    done = enumerate_requests(zygote, chosen, store, one_process[0], tmp_path, 1)
    record_property('summary', f'crash points of an upload, 1 process: {done} of '
                               f'{len(upload_plan)} requests killed (seeded subset); every '
                               'relaunch bit-identical, no committed checkpoint lost')


@pytest.mark.crash
def test_every_request_of_an_upload(zygote, one_process, store, upload_plan, tmp_path,
                                    record_property):
    done = enumerate_requests(zygote, upload_plan, store, one_process[0], tmp_path, 1)
    record_property('summary', f'crash points of an upload, 1 process: {done} requests '
                               f'killed ({", ".join(p[1] for p in upload_plan)}); every '
                               'relaunch bit-identical, no committed checkpoint lost')


def test_subset_of_the_requests_of_an_upload_in_2_processes(
        zygote, reference, store, upload_plan_2, tmp_path, record_property):
    # the kinds of request are covered in 1 process
    done = enumerate_requests(zygote, one_point(upload_plan_2), store, reference, tmp_path, 2)
    record_property('summary', f'crash points of an upload, 2 processes: {done} of '
                               f'{len(upload_plan_2)} requests killed (seeded subset); every '
                               'relaunch bit-identical on both ranks, no committed checkpoint '
                               'lost')


@pytest.fixture(scope='module')
def frozen_upload_plans(zygote, frozen_base, store, tmp_path_factory):
    """The crash points of the uploads of epochs 1 and 2 of the job with a
    frozen layer: epoch 1's sends the parts into the store's shared folder,
    epoch 2's finds them there and sends the rest, then retirement removes
    epoch 1 and what no kept checkpoint lists of the shared folder."""
    reference = frozen_base[0]
    return {epoch: traced_upload(zygote, store, tmp_path_factory.mktemp(f'frozen-up{epoch}'),
                                 1, reference, epoch, raw=True, **FROZEN)
            for epoch in (1, 2)}


def shared_requests(plan):
    return [point for point in plan if 'shared' in point[1]]


def sends_shared(lines, epoch):
    """Which frozen parts (of :data:`FROZEN_PARTS`) the requests ``lines``
    send into the shared folder before the upload of epoch ``epoch`` commits."""
    pointer = f'epoch-{epoch:04d}/manifest.json'.encode()
    end = next(i for i, line in enumerate(lines) if pointer in line)
    stems = {part: f"/shared/{part.partition('.')[0]}-".encode() for part in FROZEN_PARTS}
    return sorted(part for part, stem in stems.items()
                  if any(line.startswith(b'PUT ') and stem in line for line in lines[:end]))


def one_of_each_method(points):
    """One request of each HTTP method among ``points``, drawn with a fixed
    seed."""
    rng = random.Random(SUBSET_SEED)
    methods = sorted({point[1].split()[0] for point in points})
    return [rng.choice([point for point in points if point[1].split()[0] == method])
            for method in methods]


def test_the_requests_of_an_upload_that_sends_or_finds_a_shared_frozen_part(
        zygote, frozen_base, store, frozen_upload_plans, tmp_path, record_property):
    """Killed at one request of each method among those that name the
    shared folder (epoch 1's upload looks for the parts there before it
    sends them, epoch 2's finds them) and at the manifest of each, which
    lists the parts: nothing committed is lost, the relaunch ends
    bit-identical, and the store keeps no part that no checkpoint lists and
    lacks none that one lists (make test-crash: every request of both
    uploads)."""
    reference = frozen_base[0]
    killed = []
    for epoch, (requests, lines) in frozen_upload_plans.items():
        shared = shared_requests(requests)
        sent = [point for point in requests
                if point[1] == f'PUT epoch-{epoch:04d}/manifest.json']
        assert shared and sent, [point[1] for point in requests]
        # epoch 1's upload sends the parts; epoch 2's finds them there
        assert sends_shared(lines, epoch) == (sorted(FROZEN_PARTS) if epoch == 1 else [])
        chosen = one_of_each_method(shared) + sent
        enumerate_requests(zygote, chosen, store, reference, tmp_path / f'e{epoch}', 1, epoch,
                           **FROZEN)
        killed += [f'epoch {epoch}: {point[1]}' for point in chosen]
    record_property('summary', f'crash points of an upload with a frozen part, 1 process: '
                               f'{len(killed)} requests killed (one of each method among those '
                               f'of the shared folder, and the manifests: {"; ".join(killed)}); '
                               'every relaunch bit-identical, no committed checkpoint lost, no '
                               'shared part left over or missing')


@pytest.mark.crash
def test_every_request_of_the_uploads_with_a_frozen_part(zygote, frozen_base, store,
                                                        frozen_upload_plans, tmp_path,
                                                        record_property):
    done = sum(enumerate_requests(zygote, requests, store, frozen_base[0],
                                  tmp_path / f'e{epoch}', 1, epoch, **FROZEN)
               for epoch, (requests, _) in frozen_upload_plans.items())
    record_property('summary', f'crash points of the uploads with a frozen part, 1 process: '
                               f'{done} requests killed; every relaunch bit-identical')


@pytest.mark.crash
def test_every_request_of_an_upload_in_2_processes(zygote, reference, store, upload_plan_2,
                                                   tmp_path, record_property):
    done = enumerate_requests(zygote, upload_plan_2, store, reference, tmp_path, 2)
    record_property('summary', f'crash points of an upload, 2 processes: {done} requests '
                               f'killed ({", ".join(p[1] for p in upload_plan_2)}); every '
                               'relaunch bit-identical on both ranks, no committed checkpoint '
                               'lost')


# ------------------------------------------------- a relaunch on a new machine

def copy_run(store, source, run):
    """The checkpoints of run ``source`` copied into a run of its own (its
    staging folder is another, as on a new machine); its URL."""
    import fsspec
    bucket, _ = store
    fs = fsspec.filesystem('s3')
    fs.invalidate_cache()
    for path in fs.find(f'{bucket}/{source}'):
        rel = path[len(f'{bucket}/{source}/'):]
        if not rel.startswith('.lease'):
            fs.copy(path, f'{bucket}/{run}/{rel}')
    return f's3://{bucket}/{run}'


@pytest.fixture(scope='module')
def relaunch_source(zygote, store, tmp_path_factory):
    """A run in the bucket whose job was killed once the upload of epoch 2
    was committed: what a relaunch on a new machine resumes from."""
    bucket, _ = store
    folder = tmp_path_factory.mktemp('relaunch-source')
    run = f'source-{uuid.uuid4().hex[:8]}'
    result = zygote.launch('upload_killable.py', folder, f's3://{bucket}/{run}', 'source',
                           KILL='2:after-pointer')
    assert result.returncodes == [-9] and (folder / 'killed-source-after-pointer-rank0').exists(), \
        result.report()
    assert RemoteStorage(f's3://{bucket}/{run}').committed()[-1] == 'epoch-0002'
    return run


def relaunch_points(counted, run):
    """``(what, occurrence)`` of each request of a relaunch, from its first
    up to the first that names ``epoch-0003`` (its upload after training)."""
    end = next(i for i, line in enumerate(counted) if b'epoch-0003' in line)
    whats = [request_what(line, run, 'epoch-0002') for line in counted[:end]]
    return [(what, whats[:number].count(what)) for number, what in enumerate(whats, 1)]


@pytest.fixture(scope='module')
def relaunch_plan(zygote, one_process, store, relaunch_source, tmp_path_factory):
    """The requests of an uninterrupted relaunch on a new machine, through
    the proxy: the lease, the choice and the download."""
    _, proxy = store
    folder = tmp_path_factory.mktemp('relaunch-dry')
    run = f'dry-{uuid.uuid4().hex[:8]}'
    url = copy_run(store, relaunch_source, run)
    counter = KillAtRequest(folder / 'pid-dry-rank0', skip=0)
    proxy.on_request = counter
    try:
        zygote.launch('upload_killable.py', folder, url, 'dry',
                      AWS_ENDPOINT_URL=proxy.endpoint).check()
    finally:
        proxy.on_request = None
    assert read_json(folder / 'resumed-dry-rank0.json')['loaded_from'] == f'{url}/epoch-0002'
    assert_identical(final_state(one_process[0], 'ref'), final_state(folder, 'dry'))
    return relaunch_points(counter.counted, run)


def partial_downloads(url):
    staging = RemoteStorage(url).local_dir
    return [name for name in os.listdir(staging) if name.endswith(PARTIAL_SUFFIX)]


def relaunch_crash_at(zygote, point, store, source, folder, reference):
    """Kill a relaunch on a new machine once the store answered ``point``,
    relaunch on the same machine, check."""
    (what, occurrence), (_, proxy) = point, store
    run = f'relaunch-{uuid.uuid4().hex[:8]}'
    url = copy_run(store, source, run)
    where = f"relaunch killed at {what} (#{occurrence})"
    killer = KillAtNth(folder / 'pid-killed-rank0', run, 'epoch-0002', what, occurrence)
    proxy.on_request = killer
    try:
        result = zygote.launch('upload_killable.py', folder, url, 'killed',
                               AWS_ENDPOINT_URL=proxy.endpoint)
    finally:
        proxy.on_request = None
    assert killer.fired and result.returncodes[0] == -9, \
        f"{where}: did not fire\n{result.report()}"
    storage = RemoteStorage(url)
    assert storage.committed()[-1] == 'epoch-0002' and storage.check('epoch-0002')[1] is None, \
        f"{where}: the committed epoch-0002 was lost: {storage.committed()}"
    zygote.launch('upload_killable.py', folder, url, 'relaunch').check()
    outcome = read_json(folder / 'relaunch-rank0.json')
    assert (outcome['error'], outcome['loaded_from']) == (None, f'{url}/epoch-0002'), \
        (where, outcome)
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'relaunch'))
    assert leftovers(url) == [], where
    assert partial_downloads(url) == [], where
    # a file of the checkpoint (not its manifest, which the choice reads too)
    return what.startswith('GET epoch-0002/') and what != 'GET epoch-0002/manifest.json'


def enumerate_relaunch(zygote, points, store, source, reference, tmp_path):
    downloads = 0
    for number, point in enumerate(points, 1):
        folder = tmp_path / f'relaunch{number}'
        folder.mkdir()
        downloads += relaunch_crash_at(zygote, point, store, source, folder, reference)
    return downloads


def test_subset_of_the_requests_of_a_relaunch_on_a_new_machine(
        zygote, one_process, store, relaunch_source, relaunch_plan, tmp_path, record_property):
    """Killed at the lease (the job takes the store), at the manifest of
    the checkpoint it chose and at a file of its download (the one the
    uninterrupted relaunch requested last: the partial folder holds files,
    unchecked): the relaunch after it resumes from epoch 2, bit-identical,
    leaving nothing behind."""
    whats = [what for what, _ in relaunch_plan]
    files = [point for point in relaunch_plan if point[0].startswith('GET epoch-0002/')
             and point[0] != 'GET epoch-0002/manifest.json']
    # every file of the checkpoint is downloaded, once
    assert files and all(whats.count(what) == 1 for what, _ in files), whats
    chosen = [relaunch_plan[whats.index('PUT .lease.json')],
              relaunch_plan[whats.index('GET epoch-0002/manifest.json')], files[-1]]
    downloads = enumerate_relaunch(zygote, chosen, store, relaunch_source, one_process[0],
                                   tmp_path)
    assert downloads == 1
    record_property('summary', f'crash points of a relaunch on a new machine, 1 process: '
                               f'{len(chosen)} of {len(relaunch_plan)} requests killed (the lease, '
                               'the manifest, a file downloaded); every relaunch '
                               'bit-identical, nothing left behind')


@pytest.mark.crash
def test_every_request_of_a_relaunch_on_a_new_machine(
        zygote, one_process, store, relaunch_source, relaunch_plan, tmp_path, record_property):
    downloads = enumerate_relaunch(zygote, relaunch_plan, store, relaunch_source,
                                   one_process[0], tmp_path)
    record_property('summary', f'crash points of a relaunch on a new machine, 1 process: '
                               f'{len(relaunch_plan)} requests killed ({downloads} of them the '
                               'files downloaded); every relaunch bit-identical, nothing '
                               'left behind')

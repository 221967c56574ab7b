"""The lease of a remote checkpoint folder (skorch_accel_callbacks.storage._lease),
against a real S3 server (moto, over HTTP, through s3fs)."""

import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import skorch_accel_callbacks.storage._lease as lease_module
from s3server import Proxy, filesystem, new_bucket
from skorch_accel_callbacks.errors import FolderInUseError, LeaseLostError
from skorch_accel_callbacks.storage._lease import ObjectLease
from testutil import machine_lacks

ROOT = Path(__file__).resolve().parents[2]
ME = f"pid {os.getpid()} on host {socket.gethostname()}"


@pytest.fixture
def s3(s3_endpoint):
    fs = filesystem(s3_endpoint)
    return fs, f'{new_bucket(fs)}/run1/.lease.json'


def stored(fs, path):
    fs.invalidate_cache(path)
    return json.loads(fs.cat_file(path))


def write_dead_lease(fs, path, pid=999999, host='gone-host'):
    """A lease as a killed holder leaves it: expired an hour ago."""
    expired = datetime.now(UTC) - timedelta(hours=1)
    record = {'holder': pid, 'host': host, 'token': 'dead', 'ttl_seconds': 60.0,
              'acquired_at': (expired - timedelta(seconds=60)).isoformat(),
              'expires_at': expired.isoformat()}
    fs.pipe_file(path, json.dumps(record).encode())
    return record


def wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, 'condition never held'
        time.sleep(0.05)


def test_acquire_writes_the_holder_and_release_removes_it(s3):
    fs, path = s3
    lease = ObjectLease(fs, path).acquire()
    record = stored(fs, path)
    assert f"pid {record['holder']} on host {record['host']}" == ME
    assert lease.held and len(record['token']) == 32
    acquired = datetime.fromisoformat(record['acquired_at'])
    assert datetime.fromisoformat(record['expires_at']) - acquired == timedelta(seconds=60)
    assert lease.acquire() is lease  # once per object
    lease.release()
    assert not lease.held and not fs.exists(path)
    lease.release()  # idempotent
    ObjectLease(fs, path).acquire().release()  # free again


def test_a_second_job_is_refused_naming_the_holder(s3):
    fs, path = s3
    lease = ObjectLease(fs, path).acquire()
    token = stored(fs, path)['token']
    with pytest.raises(FolderInUseError, match='is in use by another running job') as info:
        ObjectLease(fs, path).acquire()
    assert ME in str(info.value) and f's3://{path}' in str(info.value)
    assert stored(fs, path)['token'] == token  # untouched
    lease.release()


def test_an_expired_lease_is_taken_over_with_a_warning(s3):
    fs, path = s3
    write_dead_lease(fs, path)
    with pytest.warns(UserWarning, match='from pid 999999 on host gone-host, which expired'):
        lease = ObjectLease(fs, path).acquire()
    assert stored(fs, path)['token'] not in ('dead', None)
    assert stored(fs, path)['holder'] == os.getpid()
    lease.release()
    assert not fs.exists(path)


def live_lease_of(fs, path, pid, boot_id, pid_namespace=None, started=None):
    """A lease renewed a moment ago by ``pid`` of the boot ``boot_id``, in
    the PID namespace ``pid_namespace`` (this process's by default)."""
    now = datetime.now(UTC)
    record = {'holder': pid, 'host': socket.gethostname(), 'boot_id': boot_id,
              'pid_namespace': pid_namespace or os.readlink('/proc/self/ns/pid'),
              'started': started,
              'token': 'killed', 'ttl_seconds': 3600.0, 'acquired_at': now.isoformat(),
              'expires_at': (now + timedelta(hours=1)).isoformat()}
    fs.pipe_file(path, json.dumps(record).encode())
    return record


def gone_pid():
    """The pid of a process of this machine that has ended."""
    child = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                           capture_output=True, text=True, check=True)
    pid = int(child.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_a_live_lease_of_a_killed_process_of_this_machine_is_taken_at_once(s3):
    """The same command restarted after a kill does not wait for the expiry."""
    fs, path = s3
    boot_id = Path('/proc/sys/kernel/random/boot_id').read_text().strip()
    pid = gone_pid()
    live_lease_of(fs, path, pid, boot_id)
    with pytest.warns(UserWarning, match=f'from pid {pid} on host .*, a process of this '
                                         'machine that is gone'):
        lease = ObjectLease(fs, path).acquire()
    assert stored(fs, path)['token'] != 'killed'
    lease.release()


def test_a_live_lease_whose_pid_is_now_another_process_s_is_taken_at_once(s3):
    """A pid used again by a new process (after a reboot-less restart)
    does not keep a killed holder's lease alive: its start time differs."""
    fs, path = s3
    boot_id = Path('/proc/sys/kernel/random/boot_id').read_text().strip()
    with subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) as other:
        try:
            live_lease_of(fs, path, other.pid, boot_id, started=1)
            with pytest.warns(UserWarning, match=f'from pid {other.pid} on host .*, a process '
                                                 'of this machine that is gone'):
                ObjectLease(fs, path).acquire().release()
        finally:
            other.kill()


def test_a_live_lease_of_a_killed_process_of_another_pid_namespace_runs_its_course(s3):
    """Another container of this machine: its pids mean nothing here."""
    fs, path = s3
    boot_id = Path('/proc/sys/kernel/random/boot_id').read_text().strip()
    record = live_lease_of(fs, path, gone_pid(), boot_id, pid_namespace='pid:[1]')
    with pytest.raises(FolderInUseError, match='is in use by another running job'):
        ObjectLease(fs, path).acquire()
    assert stored(fs, path) == record


@pytest.mark.slow  # two fresh interpreters in namespaces of their own
def test_a_job_in_another_pid_namespace_is_refused_a_live_lease(s3, s3_endpoint):
    """Two containers (pods) of one machine: the second job, in a PID
    namespace of its own, cannot see the first's pid and must not take its
    live lease for a killed process's."""
    if shutil.which('unshare') is None or os.geteuid() != 0:
        machine_lacks('unshare (util-linux) and root')
    fs, path = s3
    held = ObjectLease(fs, path).acquire()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests' / 'support')!r}]
        from s3server import filesystem
        from skorch_accel_callbacks.storage._lease import ObjectLease
        from skorch_accel_callbacks.errors import FolderInUseError
        print(os.readlink('/proc/self/ns/pid'), flush=True)
        try:
            os.kill({os.getpid()}, 0)
        except ProcessLookupError:
            print('holder not visible', flush=True)
        try:
            ObjectLease(filesystem({s3_endpoint!r}), {path!r}).acquire()
        except FolderInUseError as error:
            print('refused:', error, flush=True)
        else:
            print('taken', flush=True)
    """)
    done = subprocess.run(['unshare', '--pid', '--fork', '--mount-proc', sys.executable,
                           '-c', script], capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 0, done.stderr
        namespace, visible, outcome = done.stdout.strip().splitlines()
        # the job ran in another PID namespace, where the holder's pid is unknown
        assert namespace != os.readlink('/proc/self/ns/pid')
        assert visible == 'holder not visible'
        assert outcome.startswith('refused: checkpoint folder') and 'in use by' in outcome
        assert held.held
        held.check()
    finally:
        held.release()


def test_a_live_lease_of_another_boot_is_refused_whatever_its_pid(s3):
    fs, path = s3
    record = live_lease_of(fs, path, gone_pid(), 'another-boot')
    with pytest.raises(FolderInUseError, match='is in use by another running job'):
        ObjectLease(fs, path).acquire()
    assert stored(fs, path) == record


def test_a_lease_within_the_clock_skew_is_not_taken_over(s3):
    fs, path = s3
    record = write_dead_lease(fs, path)
    with pytest.raises(FolderInUseError, match='pid 999999 on host gone-host'):
        ObjectLease(fs, path, clock_skew_seconds=2 * 3600).acquire()
    assert stored(fs, path) == record


def test_of_two_takers_of_an_expired_lease_exactly_one_wins(s3, monkeypatch):
    fs, path = s3
    write_dead_lease(fs, path)
    # both read the expired lease before either writes (the real read, then
    # a meeting): the conditional overwrite, If-Match on the expired lease's
    # ETag, is what decides
    both_read = threading.Barrier(2, timeout=60)
    real_read = lease_module._read
    dead_reads = []

    def read_then_meet(fs_, path_, ttl_seconds):
        found = real_read(fs_, path_, ttl_seconds)
        if found is not None and found[0]['token'] == 'dead':
            dead_reads.append(found[1])
            both_read.wait()
        return found

    monkeypatch.setattr(lease_module, '_read', read_then_meet)
    outcomes = []

    def take():
        lease = ObjectLease(fs, path)
        try:
            outcomes.append(('won', lease.acquire()))
        except FolderInUseError as error:
            outcomes.append(('refused', error))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        threads = [threading.Thread(target=take) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert len(dead_reads) == 2 and dead_reads[0] == dead_reads[1]
    assert sorted(kind for kind, _ in outcomes) == ['refused', 'won'], outcomes
    winner, = [lease for kind, lease in outcomes if kind == 'won']
    error, = [error for kind, error in outcomes if kind == 'refused']
    took_over = [w for w in caught if 'took over' in str(w.message)]
    assert len(took_over) == 1
    assert 'is in use by another running job' in str(error) and ME in str(error)
    assert stored(fs, path)['token'] == winner._held.record['token']
    winner.release()


def test_renewal_keeps_a_short_lease_alive(s3):
    fs, path = s3
    lease = ObjectLease(fs, path, ttl_seconds=1.0, clock_skew_seconds=0).acquire()
    first = stored(fs, path)
    seen = {first['expires_at']}
    wait_for(lambda: seen.add(stored(fs, path)['expires_at']) or len(seen) > 5)
    now = stored(fs, path)
    assert now['token'] == first['token']
    assert datetime.fromisoformat(now['expires_at']) > datetime.fromisoformat(
        first['expires_at']) + timedelta(seconds=1)  # more than one ttl on
    with pytest.raises(FolderInUseError, match='is in use'):
        ObjectLease(fs, path, ttl_seconds=1.0, clock_skew_seconds=0).acquire()
    lease.check()
    lease.release()
    assert not fs.exists(path)


# the leases of the tests through the proxy: deadlines of 2 s (a third),
# room for a loaded machine to send a request through it in time (with 1 s
# a create under a full make test missed its deadline)
LEASE_SECONDS = 6.0


def lose_the_answer_of_a_lease_write(proxy, path, passed=0, held_seconds=0):
    """From now on, the proxy drops the answer of a write (PUT) of the lease
    ``path``, the first after ``passed`` of them (the store has made it; the
    job never hears so), holding its connection ``held_seconds`` before it
    closes it; the list it returns names that request once the store
    answered it."""
    key = path.split('/', 1)[1].encode()
    writes, lost = [], []

    def at_answer(line):  # instead of forwarding it
        lost.append(line)
        time.sleep(held_seconds)

    def on_request(line):
        if not (line.startswith(b'PUT /') and key in line):
            return None
        writes.append(line)
        if len(writes) == passed + 1:
            return lambda: at_answer(line)
        return None

    proxy.on_request = on_request
    return lost


@pytest.fixture
def proxied(s3_endpoint):
    """A lease's path in a new bucket, the store seen through a test proxy
    (``fs``) and directly (``direct``, for the test's own reads)."""
    proxy = Proxy(int(s3_endpoint.rsplit(':', 1)[1]))
    direct = filesystem(s3_endpoint)
    bucket = new_bucket(direct)
    fs = filesystem(proxy.endpoint)
    # the client's first request makes its connection pool (its TLS contexts
    # read in a thread), which on a busy machine can take longer than a short
    # lease's deadline for a write: these tests time the store, not that
    fs.ls(bucket)
    yield proxy, fs, direct, f'{bucket}/run1/.lease.json'
    proxy.cut()


def assert_released_silently(lease, direct, path):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        lease.release()
    assert not direct.exists(path)


def test_a_renewal_whose_answer_was_lost_is_no_loss_of_the_lease(proxied):
    """The store took a renewal whose answer never came back (a dropped
    connection, or a write given up at its deadline while under way): the
    lease is at a version whose ETag the holder never heard of, and its next
    conditional write fails. The lease is still its own (its token): the
    renewals go on, nothing is reported lost, the release removes it."""
    proxy, fs, direct, path = proxied
    lease = ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, renew_every=1.0,
                        clock_skew_seconds=0).acquire()
    token = stored(direct, path)['token']
    lost = lose_the_answer_of_a_lease_write(proxy, path)
    wait_for(lambda: lost)
    seen = {stored(direct, path)['expires_at']}
    wait_for(lambda: seen.add(stored(direct, path)['expires_at']) or len(seen) > 3)
    lease.check()
    assert lease.held and stored(direct, path)['token'] == token
    assert_released_silently(lease, direct, path)


def test_a_check_whose_renewal_answer_was_lost_and_the_release_after_it(proxied):
    """The same loss in ``check()`` (the thread's renewals far apart): it
    raises nothing and the release removes the lease without a warning."""
    proxy, fs, direct, path = proxied
    lease = ObjectLease(fs, path, ttl_seconds=600, clock_skew_seconds=0).acquire()
    before = stored(direct, path)
    lost = lose_the_answer_of_a_lease_write(proxy, path)
    with contextlib.suppress(OSError):  # the store out of reach, as check() says
        lease.check()
    wait_for(lambda: lost)
    assert stored(direct, path)['expires_at'] != before['expires_at']  # the store took it
    assert lease.held
    assert_released_silently(lease, direct, path)


def test_a_takeover_whose_answer_was_lost_takes_the_lease(proxied):
    """The write that takes over an expired lease, taken by the store with
    its answer lost: the lease found then is this job's own (its token),
    not another job's that got there first."""
    proxy, fs, direct, path = proxied
    write_dead_lease(direct, path)
    lost = lose_the_answer_of_a_lease_write(proxy, path, passed=1)  # after the create-only one
    with pytest.warns(UserWarning, match='took over'):
        lease = ObjectLease(fs, path, clock_skew_seconds=0).acquire()
    assert lost, 'the takeover was answered'
    assert lease.held and stored(direct, path)['token'] == lease._held.record['token']
    assert_released_silently(lease, direct, path)


def test_a_create_whose_answer_was_lost_takes_the_lease(proxied):
    """The create-only write that takes a free lease, made by the store with
    its answer lost: the client's retry of it finds a lease there, and that
    lease is this job's own (its token), not another running job's."""
    proxy, fs, direct, path = proxied
    lost = lose_the_answer_of_a_lease_write(proxy, path)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        lease = ObjectLease(fs, path, clock_skew_seconds=0).acquire()
    assert lost, 'the create was answered'
    assert lease.held and stored(direct, path)['token'] == lease._held.record['token']
    assert_released_silently(lease, direct, path)


def test_a_create_given_up_at_its_deadline_takes_the_lease_the_store_made(proxied):
    """The same create, its answer held past the write's deadline (a third
    of the lease's ``ttl_seconds``): the client gives it up, and the lease
    the store made is this job's."""
    proxy, fs, direct, path = proxied
    # held far longer than the deadline: a client that did not give the
    # create up would wait for the connection to close, then retry
    lost = lose_the_answer_of_a_lease_write(proxy, path, held_seconds=10)
    began = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        lease = ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, clock_skew_seconds=0).acquire()
    assert lost, 'the create was answered'
    assert time.monotonic() - began < 10, 'the create was not given up at its deadline'
    assert lease.held and stored(direct, path)['token'] == lease._held.record['token']
    assert_released_silently(lease, direct, path)


def test_a_create_the_store_did_not_make_fails_the_acquire(proxied):
    """A create that never reached the store (its connection closed at it,
    each retry's too, until the write's deadline) leaves no lease: the
    acquire, having looked, raises the write's error, taking nothing."""
    proxy, fs, direct, path = proxied
    proxy.drop_on = rb'PUT /\S*\.lease\.json'
    with pytest.raises(TimeoutError):
        # deadlines of 3 s: the look's request, on a new connection, must
        # reach the store within its deadline on a loaded machine too
        ObjectLease(fs, path, ttl_seconds=9.0, clock_skew_seconds=0).acquire()
    assert proxy.fired.is_set()
    key = path.split('/', 1)[1].encode()
    assert any(line.startswith(b'HEAD /') and key in line for line in proxy.requests)
    assert not direct.exists(path)


def test_a_store_that_made_the_create_and_went_silent_fails_the_acquire_in_time(proxied):
    """The store makes the create and answers nothing from then on: the
    acquire gives up the create and then its look at the lease, each at
    the write's deadline, instead of waiting for the client's read timeout
    and retries (minutes)."""
    proxy, fs, direct, path = proxied
    key = path.split('/', 1)[1].encode()

    def on_request(line):
        if line.startswith(b'PUT /') and key in line:
            return proxy.silence  # at the create's answer, instead of it
        return None

    proxy.on_request = on_request
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, clock_skew_seconds=0).acquire()
    assert proxy.silent and direct.exists(path), 'the store did not make the create'
    # two deadlines of 2 s, and room for a busy machine
    assert time.monotonic() - began < 15


# a look at the lease held this long by the store: far past a read's
# deadline (a third of LEASE_SECONDS), short of botocore's read timeout
SLOW_LOOK = (rb'HEAD /\S*\.lease\.json', 30)


def looks_held(proxy, path):
    """The looks at the lease (its HEAD) that the proxy held."""
    key = path.split('/', 1)[1].encode()
    return [line for line in proxy.delayed if line.startswith(b'HEAD /') and key in line]


def test_a_store_slow_to_show_a_live_lease_fails_the_acquire_in_time(proxied):
    """Another job holds the lease, and the store holds the look at it
    (the takeover's) unanswered: the acquire gives the look up at its
    deadline, as it does a write, instead of waiting as long as the store
    does (until botocore's read timeout, then its retries)."""
    proxy, fs, direct, path = proxied
    live = datetime.now(UTC) + timedelta(minutes=10)
    direct.pipe_file(path, json.dumps({
        'holder': 4242, 'host': 'another-host', 'token': 'theirs', 'ttl_seconds': 600.0,
        'acquired_at': datetime.now(UTC).isoformat(), 'expires_at': live.isoformat()}).encode())
    proxy.delay_on = SLOW_LOOK
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, clock_skew_seconds=0).acquire()
    assert looks_held(proxy, path), 'the look was not held'
    assert time.monotonic() - began < SLOW_LOOK[1] / 2
    assert stored(direct, path)['token'] == 'theirs'


def test_a_check_whose_renewal_and_look_go_unanswered_raises_in_time(proxied):
    """A renewal that never reaches the store, and the look at the lease
    that follows it held unanswered: ``check()`` raises the store's
    timeout in time, and the lease is still held once the store answers."""
    proxy, fs, direct, path = proxied
    lease = ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, renew_every=LEASE_SECONDS - 0.1,
                        clock_skew_seconds=0).acquire()
    proxy.drop_on = rb'PUT /\S*\.lease\.json'
    proxy.delay_on = SLOW_LOOK
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        lease.check()
    assert looks_held(proxy, path), 'the look was not held'
    # the renewal thread's own try may come first: two of each deadline
    assert time.monotonic() - began < SLOW_LOOK[1] / 2
    proxy.drop_on = proxy.delay_on = None
    lease.check()
    assert lease.held
    assert_released_silently(lease, direct, path)


def test_a_release_whose_look_goes_unanswered_warns_in_time(proxied):
    """The lease moved on to a version whose answer the job never heard of
    (a renewal the store took, its answer lost), so the removal, conditional
    on the version the job knows, fails; the look at the lease that follows
    is held unanswered. The release gives the look up at its deadline and
    warns that the lease stays until it expires, instead of waiting as long
    as the store does."""
    proxy, fs, direct, path = proxied
    lease = ObjectLease(fs, path, ttl_seconds=LEASE_SECONDS, renew_every=LEASE_SECONDS - 0.1,
                        clock_skew_seconds=0).acquire()
    proxy.delay_on = SLOW_LOOK
    direct.pipe_file(path, json.dumps(dict(stored(direct, path), expires_at=datetime.now(
        UTC).isoformat())).encode())
    began = time.monotonic()
    with pytest.warns(UserWarning, match='could not remove the lease'):
        lease.release()
    assert looks_held(proxy, path), 'the look was not held'
    assert time.monotonic() - began < SLOW_LOOK[1] / 2
    assert not lease.held and direct.exists(path)


def expire_and_take_over(fs, path):
    """A holder that stops renewing (suspended); another job takes its lease."""
    held = ObjectLease(fs, path, ttl_seconds=1.0, renew_every=0.999,
                       clock_skew_seconds=0)
    held.acquire()
    held._held.stopped.set()  # as if the process were stopped: no renewals
    expires = datetime.fromisoformat(stored(fs, path)['expires_at'])
    wait_for(lambda: datetime.now(UTC) > expires)
    with pytest.warns(UserWarning, match='took over'):
        taker = ObjectLease(fs, path, clock_skew_seconds=0).acquire()
    return held, taker


def test_a_lease_taken_over_while_held_is_reported_lost_at_release(s3):
    fs, path = s3
    held, taker = expire_and_take_over(fs, path)
    taker_token = stored(fs, path)['token']
    assert taker_token != held._held.record['token']
    with pytest.warns(UserWarning, match=f'lost the lease s3://{path}.*another job \\({ME}\\)'):
        held.release()
    assert stored(fs, path)['token'] == taker_token  # the taker's lease is not removed
    taker.release()


def test_check_raises_once_the_lease_was_taken_over(s3):
    fs, path = s3
    held, taker = expire_and_take_over(fs, path)
    with pytest.raises(LeaseLostError, match='took it over'):
        held.check()
    assert not held.held
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        held.release()  # check() said it already
    taker.release()


def test_a_copy_of_a_held_lease_holds_nothing(s3):
    fs, path = s3
    lease = ObjectLease(fs, path).acquire()
    copy = pickle.loads(pickle.dumps(lease))
    assert lease.held and not copy.held
    copy.release()  # releases nothing
    assert fs.exists(path)
    with pytest.raises(FolderInUseError, match=ME):
        copy.acquire()
    lease.release()
    copy.acquire().release()


def test_bad_renewal_settings_are_refused_before_writing(s3):
    fs, path = s3
    with pytest.raises(ValueError, match='renew_every=5 must be'):
        ObjectLease(fs, path, ttl_seconds=5, renew_every=5).acquire()
    assert not fs.exists(path)


@pytest.mark.slow
def test_a_job_that_exits_without_release_removes_its_lease_silently(s3, s3_endpoint):
    fs, path = s3
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests' / 'support')!r}]
        from s3server import filesystem
        from skorch_accel_callbacks.storage._lease import ObjectLease
        kept = ObjectLease(filesystem({s3_endpoint!r}), {path!r}).acquire()
        print(kept.url, flush=True)
    """)
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f's3://{path}' and done.stderr == ''
    assert not fs.exists(path)


def test_a_lease_collected_in_another_thread_leaves_this_thread_s_warnings_alone(s3_endpoint):
    """The collector releases a dropped lease in whichever thread drops it
    last; that release says nothing, and must not hush warnings by swapping
    the process's warning filters (``warnings.catch_warnings`` does), which
    would hide what this thread records meanwhile."""
    proxy = Proxy(int(s3_endpoint.rsplit(':', 1)[1]))
    fs = filesystem(proxy.endpoint)
    path = f'{new_bucket(fs)}/run1/.lease.json'
    held = [ObjectLease(fs, path).acquire()]
    proxy.delay_on = (rb'^DELETE /', 2)  # the removal of the lease takes 2 s
    dropper = threading.Thread(target=held.clear)
    dropper.start()
    try:
        assert proxy.fired.wait(30), 'the collected lease was not released'
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            dropper.join(60)
            assert not dropper.is_alive()
            warnings.warn('recorded while the lease was released', UserWarning)
        assert not fs.exists(path)
    finally:
        proxy.cut()
    assert [str(w.message) for w in caught] == ['recorded while the lease was released']

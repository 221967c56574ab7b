"""Checkpoints in an object store: what training waits, the upload, the download.

usage: python benchmarks/bench_remote.py [--sizes 25e6] [--repeats 5]
       [--quick] [--back-to-back 6] [--back-to-back-only] [--server-nice 0]
       [--dir runs/bench-remote]

``make bench-s3`` runs it as it is: 2.5-3 minutes on 2 shared cores, where
the local server moves 15-75 MB/s; ``--sizes 100e6 --repeats 5`` (1.1 GiB a
checkpoint) took 10.5-11.5 minutes there.

Against a local S3 server that the script starts itself (moto's
``ThreadedMotoServer`` on 127.0.0.1, port 0, as ``tests/support/s3server.py``), in a
process of its own, so that the server's request handling does not share
the benchmark's interpreter lock, with its objects in memory
(``/dev/shm``), so that it does not share the disk of the saves timed (a
real store is another machine). The
nets are those of ``bench_checkpoint.py`` (stacks of 1024x1024 linear
layers after one Adam step), one process. In each repeat, in turn:

- *local*: ``AccelerateCheckpoint(dirname=<a path>).save_model``, the time
  training is blocked (durable, the default);
- *remote*: the same net's ``save_model`` with ``dirname='s3://bench/run'``,
  the time training is blocked: the commit into the staging folder and the
  start of the upload;
- *ours up*: from ``save_model``'s return until ``wait_for_saves`` returns:
  the background upload (files, create-only manifest, ``latest.json``, a
  listing for retention, which removes nothing here);
- *s3fs put*: ``S3FileSystem.put`` of the same staged folder (recursive)
  to another prefix of the same server, s3fs's defaults as ours;
- *s3fs put, same checksum*: the same with ``ChecksumAlgorithm='CRC32'``,
  as ours. botocore sends each part's CRC32 either way; without the
  argument the object's checksum is a full-object one, which moto
  computes by copying the whole object twice more at the completion (a
  real store computes it as the bytes arrive); with it, ours and this,
  moto combines the parts' CRC32s;
- *ours down*: ``open_storage(url, local_dir=<empty>).find_checkpoint()``,
  the download of a resume on a new machine: listing, the manifest, the
  files, then the size and checksum of every file (``_manifest.check_manifest``);
- *s3fs get*: ``S3FileSystem.get`` of the same checkpoint folder (recursive)
  into an empty folder;
- *checksums*: ``_manifest.check_manifest`` of our downloaded folder, timed alone right
  after the download (the page cache warm, as in the download): the share
  of the download that is the size and checksum check;
- *one stream*: ``S3FileSystem.get`` as *s3fs get*, with
  ``max_concurrency=1``: each file in one GET instead of parts of 50 MiB in
  parallel ranged GETs. moto reads a whole object for every ranged GET of
  it, so against moto the parallel download of a file of n parts costs the
  server n+1 reads of the file, where a real store reads each byte once.

Then, per size, *saves back to back* (``--back-to-back``, the saves of
each series): a series of saves each right after the one before, with
nothing waited for between them (``every_n_steps`` faster than the store),
into a local ``dirname``, then into ``s3://`` (``keep_last=2`` for both),
each save's blocked time (the os.sync before each is not timed), and the
end of fit's ``wait_for_saves`` after each series: for s3 the uploads
still queued. ``--sizes 25e6,100e6 --back-to-back-only`` gives the row for
both sizes in one run. ``--server-nice 19`` runs the server at the lowest
priority: on 2 cores the server's request handling otherwise takes a core
from the saves it is timing, which a store on another machine does not.

The local save comes right before the remote one; our upload and s3fs's
``put`` (and the downloads) alternate which goes first from one repeat to
the next.
Every timed call but the upload's wait (timed as soon as ``save_model``
returns) starts once the server has used no CPU for 0.5 s and the page
cache is flushed (``os.sync``); the CPU seconds of this process and of the
server's are recorded with each figure (the medians are reported), to show
which side a transfer waits for. One save of each kind before the repeats
is not timed (a process's first save is slow). Every ratio is taken
between figures of the same repeat; the tables give min and median of each
figure and of the ratios.
"""

import argparse
import datetime
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / 'tests' / 'support'), str(REPO / 'benchmarks')]

from bench_checkpoint import folder_bytes, machine, new_epoch, table, trained_net  # noqa: E402

BUCKET = 'bench'
# Completing a multipart upload of hundreds of MB takes moto longer than
# botocore's 60 s read timeout on a busy machine; the retry then fails
# (NoSuchUpload). The same timeout on both sides.
S3_OPTIONS = {'config_kwargs': {'read_timeout': 900}}
# the server's process, set in main()
SERVER_PID = None
# the arguments of our upload's requests (transfer.py)
VERIFIED = {'ChecksumAlgorithm': 'CRC32'}
CREDENTIALS = {'AWS_ACCESS_KEY_ID': 'bench', 'AWS_SECRET_ACCESS_KEY': 'bench',
               'AWS_DEFAULT_REGION': 'us-east-1'}


def serve():
    """The server process: start moto's server, print its endpoint, wait
    until stdin closes (the benchmark ended or died)."""
    import logging

    from s3server import start_server
    logging.getLogger('werkzeug').setLevel(logging.WARNING)
    server, endpoint = start_server()
    print(endpoint, flush=True)
    sys.stdin.read()
    server.stop()


def start_server_process(nice=0):
    """The server's process (at niceness ``nice``) and its endpoint URL."""
    # moto keeps an object over 16 MiB in a temporary file, which it deletes
    # when it is garbage-collected: on this disk (ext4 with ``discard``) the
    # deletion would stall the fsyncs of whichever save is timed next. In
    # memory, the store does not share the disk of the saves, as a real one.
    temp = '/dev/shm' if os.path.isdir('/dev/shm') else None
    proc = subprocess.Popen([sys.executable, __file__, '--serve'], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **({'TMPDIR': temp} if temp else {})),
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith('http://'):
        proc.kill()
        raise RuntimeError(f"the S3 server did not start (it printed {endpoint!r})")
    return proc, endpoint


def cpu_ticks(pid):
    """CPU time the process ``pid`` used so far, in clock ticks (Linux)."""
    fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def settle(pid, quiet=0.5, longest=20.0):
    """Wait until the server process ``pid`` has used no CPU for ``quiet``
    seconds: it frees the memory of a large transfer after answering it,
    which would slow down whatever is timed next."""
    if not os.path.exists(f'/proc/{pid}/stat'):
        time.sleep(quiet)
        return
    deadline = time.monotonic() + longest
    before = cpu_ticks(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = cpu_ticks(pid)
        if now == before:
            return
        before = now


# CPU seconds of this process and of the server during each timed call,
# by the key of its figure: set by ``timed(..., key=)``
CPU = {}


def own_cpu():
    """CPU seconds this process used so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, quiet=True, key=None):
    """Seconds ``fn`` takes and its result; ``quiet``: starting once the
    server is idle and the page cache flushed; ``key``: the CPU seconds of
    both sides are appended to ``CPU[key]``."""
    if quiet:
        settle(SERVER_PID)
        os.sync()  # no transfer pays for the writeback of an earlier save
    ticks, cpu = cpu_ticks(SERVER_PID), own_cpu()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    if key:
        CPU.setdefault(key, []).append(
            (own_cpu() - cpu, (cpu_ticks(SERVER_PID) - ticks) / os.sysconf('SC_CLK_TCK')))
    return seconds, result


def bench_size(size, repeats, root, fs):
    """The figures of each repeat for one net size (seconds)."""
    from skorch_accel_callbacks import AccelerateCheckpoint
    from skorch_accel_callbacks.format import check_manifest
    from skorch_accel_callbacks.storage import open_storage

    net = trained_net(size)
    root = Path(root) / f'size-{size:g}'
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    url = f's3://{BUCKET}/size-{size:g}'
    # retention would delete the checkpoint before during the upload (in the
    # store) or during the remote save and upload (locally: its background
    # removal of 1.1 GiB at 100M took 0.5-1 s of this process's CPU and the
    # disk); here that is done between repeats, untimed
    local = AccelerateCheckpoint(dirname=str(root / 'local'), keep_last=10 ** 6)
    remote = AccelerateCheckpoint(dirname=url, local_dir=str(root / 'staging'),
                                  keep_last=10 ** 6, storage_options=S3_OPTIONS)
    for cp in (local, remote):
        cp.initialize().on_train_begin(net)
    times = {key: [] for key in ('local', 'remote', 'ours_up', 's3fs_put', 's3fs_put_crc32',
                                 'ours_down', 's3fs_get', 'checksums', 'one_stream')}
    CPU.clear()

    def save(cp, key):
        new_epoch(net)
        blocked, path = timed(lambda: cp.save_model(net))
        # at once: the upload runs from inside save_model
        waited, _ = timed(lambda: cp.wait_for_saves(net), quiet=False,
                          key='ours_up' if key == 'remote' else None)
        if key:
            times[key].append(blocked)
        return path, waited

    def upload_ours():
        path, waited = save(remote, 'remote')
        times['ours_up'].append(waited)
        return path

    def upload_s3fs(name, i):
        staged = root / 'staging' / name
        for key, options in (('s3fs_put', {}), ('s3fs_put_crc32', VERIFIED))[::1 - 2 * (i % 2)]:
            seconds, _ = timed(lambda: fs.put(str(staged), f'{BUCKET}/{key}/{i}',
                                              recursive=True, **options), key=key)
            times[key].append(seconds)

    def download_ours(i):
        seconds, found = timed(lambda: open_storage(
            url, local_dir=str(root / f'new-machine-{i}'),
            storage_options=S3_OPTIONS).find_checkpoint(), key='ours_down')
        times['ours_down'].append(seconds)
        seconds, (_, problems) = timed(lambda: check_manifest(found.path), quiet=False,
                                       key='checksums')
        if problems:
            raise RuntimeError(f"the download of {found.path} is damaged: {problems}")
        times['checksums'].append(seconds)
        return found

    def download_s3fs(name, i, key='s3fs_get', **options):
        target = root / f'{key}-{i}'
        seconds, _ = timed(lambda: fs.get(f'{BUCKET}/size-{size:g}/{name}', str(target),
                                          recursive=True, **options), key=key)
        times[key].append(seconds)
        return target

    # not timed: a process's first save of each kind
    local_before = save(local, None)[0]
    name = os.path.basename(save(remote, None)[0])
    for i in range(repeats):
        ours_first = i % 2 == 0
        if not ours_first:
            upload_s3fs(name, i)  # the staged copy of the save before
        # the two saves one after the other, each first in turn: a save
        # right after a large transfer of this process, or right after the
        # other save, took up to 3x as long here
        if i % 2 == 0:
            local_path = save(local, 'local')[0]
            previous, name = name, os.path.basename(upload_ours())
        else:
            previous, name = name, os.path.basename(upload_ours())
            local_path = save(local, 'local')[0]
        if ours_first:
            upload_s3fs(name, i)
        fs.rm(f'{BUCKET}/size-{size:g}/{previous}', recursive=True)
        for key in ('s3fs_put', 's3fs_put_crc32'):
            fs.rm(f'{BUCKET}/{key}/{i}', recursive=True)
        if ours_first:
            found = download_ours(i)
            target = download_s3fs(name, i)
        else:
            target = download_s3fs(name, i)
            found = download_ours(i)
        if os.path.basename(found.path) != name:
            raise RuntimeError(f"downloaded {found.path}, not the checkpoint {name}")
        nbytes = folder_bytes(root / 'staging' / name)
        if not folder_bytes(target) == folder_bytes(found.path) == nbytes:
            raise RuntimeError(f"a download of {name} does not hold its {nbytes} bytes")
        shutil.rmtree(target)
        shutil.rmtree(root / f'new-machine-{i}')
        shutil.rmtree(download_s3fs(name, i, 'one_stream', max_concurrency=1))
        shutil.rmtree(local_before)
        local_before = local_path
    for cp in (local, remote):
        cp.close()
    fs.rm(f'{BUCKET}/size-{size:g}', recursive=True)
    shutil.rmtree(root)
    return dict(size=sum(p.numel() for p in net.module_.parameters()), nbytes=nbytes,
                times=times, cpu=dict(CPU))


def bench_back_to_back(size, saves, root):
    """Saves back to back (none waits for anything before it): the seconds
    each of ``saves`` saves blocks training, into a local ``dirname`` then
    into ``s3://``, and how long the end of fit's ``wait_for_saves`` takes
    after each series (for s3, the uploads still queued)."""
    from skorch_accel_callbacks import AccelerateCheckpoint

    net = trained_net(size)
    root = Path(root) / f'back-to-back-{size:g}'
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    url = f's3://{BUCKET}/back-to-back-{size:g}'
    times, said = {}, []
    for key, cp in (('local', AccelerateCheckpoint(dirname=str(root / 'local'))),
                    ('remote', AccelerateCheckpoint(dirname=url, local_dir=str(root / 'staging'),
                                                    storage_options=S3_OPTIONS,
                                                    sink=said.append))):
        cp.initialize().on_train_begin(net)
        new_epoch(net)
        cp.save_model(net)  # not timed: a process's first save of each kind
        cp.wait_for_saves(net)
        blocked = []
        for _ in range(saves):
            new_epoch(net)
            os.sync()  # neither series pays for the writeback of the other's
            blocked.append(timed(lambda cp=cp: cp.save_model(net), quiet=False)[0])
        times[key] = blocked
        times[f'{key}_end'] = [timed(lambda cp=cp: cp.wait_for_saves(net), quiet=False)[0]]
        cp.close()
    shutil.rmtree(root)
    return dict(size=sum(p.numel() for p in net.module_.parameters()), times=times,
                said=[line for line in said if not line.startswith('Saved checkpoint')])


def back_to_back_rows(result):
    times = result['times']
    ratios = [a / b for a, b in zip(times['remote'], times['local'], strict=True)]
    return [[f"{result['size'] / 1e6:.0f}M", 'blocked per save, saves back to back',
             ms(min(times['remote'])), ms(statistics.median(times['remote'])),
             ms(min(times['local'])), ms(statistics.median(times['local'])),
             f"{min(ratios):.2f}", f"{statistics.median(ratios):.2f}", f"{max(ratios):.2f}",
             ms(times['remote_end'][0]), ms(times['local_end'][0])]]


def back_to_back_report(results):
    out = ['Saves back to back (each right after the one before, no wait between), '
           's3:// vs local dirname, keep_last=2: the time each save blocked training '
           '(ms; min, median), the ratio per save, and the end of fit\'s wait '
           '(wait_for_saves: for s3, the uploads still queued).', '',
           table([row for result in results for row in back_to_back_rows(result)],
                 ['params', 'what', 's3 min', 's3 median', 'local min', 'local median',
                  'ratio min', 'ratio median', 'ratio max', 's3 end', 'local end'])]
    for result in results:
        for key, values in result['times'].items():
            out.append(f"- {result['size'] / 1e6:.0f}M {key}: "
                       + ', '.join(ms(value) for value in values))
        out += [f"- {result['size'] / 1e6:.0f}M said: {line}" for line in result['said']]
    return '\n'.join(out)


def ms(seconds):
    return f"{seconds * 1000:.0f}"


def rows_of(result):
    times = result['times']
    pairs = (('blocked per save', 'remote', 'local'), ('upload', 'ours_up', 's3fs_put'),
             ('upload, same checksum', 'ours_up', 's3fs_put_crc32'),
             ('download at resume', 'ours_down', 's3fs_get'))
    rows = []
    for label, ours, theirs in pairs:
        ratios = [a / b for a, b in zip(times[ours], times[theirs], strict=True)]
        rows.append([f"{result['size'] / 1e6:.0f}M", f"{result['nbytes'] / 2 ** 20:.0f}", label,
                     ms(min(times[ours])), ms(statistics.median(times[ours])),
                     ms(min(times[theirs])), ms(statistics.median(times[theirs])),
                     f"{min(ratios):.2f}", f"{statistics.median(ratios):.2f}",
                     f"{max(ratios):.2f}"])
    return rows


def cpu_rows_of(result):
    """Per figure: its median wall time and the median CPU seconds of this
    process and of the server during it."""
    times, cpu = result['times'], result['cpu']
    rows = []
    for key in ('ours_up', 's3fs_put', 's3fs_put_crc32', 'ours_down', 's3fs_get', 'checksums',
                'one_stream'):
        ours, server = zip(*cpu[key], strict=True)
        rows.append([f"{result['size'] / 1e6:.0f}M", key, ms(min(times[key])),
                     ms(statistics.median(times[key])), ms(max(times[key])),
                     f"{statistics.median(ours):.1f}", f"{statistics.median(server):.1f}"])
    return rows


def report(results, args, elapsed):
    load = os.getloadavg()
    out = [f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
           f"{machine()}; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
           f"{args.repeats} repeats; {elapsed:.0f} s in all. Times in ms; ours vs theirs: "
           "remote vs local dirname, our upload vs s3fs put, our download vs s3fs get.", '',
           table([row for result in results for row in rows_of(result)],
                 ['params', 'MiB', 'what', 'ours min', 'ours median', 'theirs min',
                  'theirs median', 'ratio min', 'ratio median', 'ratio max']),
           '', 'Each figure: wall time (ms) and median CPU seconds of this process and '
           'of the server.', '',
           table([row for result in results for row in cpu_rows_of(result)],
                 ['params', 'figure', 'min', 'median', 'max', 'cpu here', 'cpu server']),
           '', 'Per repeat (ms):']
    for result in results:
        for key, values in result['times'].items():
            out.append(f"- {result['size'] / 1e6:.0f}M {key}: "
                       + ', '.join(ms(value) for value in values))
    return '\n'.join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sizes', default='25e6')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--quick', action='store_true', help='size 25e6, 2 repeats')
    parser.add_argument('--back-to-back', type=int, default=6, metavar='SAVES',
                        help='saves of each series back to back, per size (0: none)')
    parser.add_argument('--back-to-back-only', action='store_true',
                        help='only the saves back to back')
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-remote'))
    parser.add_argument('--server-nice', type=int, default=0, metavar='N',
                        help="the S3 server's niceness: a real store is another machine, "
                             "whose CPU the saves timed do not share (19: the server gets "
                             "only what training leaves)")
    parser.add_argument('--serve', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.quick:
        args.sizes, args.repeats = '25e6', 2
    started = time.monotonic()
    server, endpoint = start_server_process(args.server_nice)
    global SERVER_PID
    SERVER_PID = server.pid
    try:
        # the callbacks' and our s3fs's way to the server: the environment
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **S3_OPTIONS)
        fs.mkdir(BUCKET)
        results, back_to_back = [], []
        for size in (float(s) for s in args.sizes.split(',')):
            if not args.back_to_back_only:
                results.append(bench_size(size, args.repeats, args.dir, fs))
            if args.back_to_back:
                back_to_back.append(bench_back_to_back(size, args.back_to_back, args.dir))
            print(f"size {size:g} done", file=sys.stderr, flush=True)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    if results:
        print(report(results, args, time.monotonic() - started))
    if back_to_back:
        load = os.getloadavg()
        print(f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
              f"{machine()}; load average at the end {load[0]:.1f} / {load[1]:.1f} / "
              f"{load[2]:.1f}; {time.monotonic() - started:.0f} s in all.\n")
        print(back_to_back_report(back_to_back))


if __name__ == '__main__':
    main()

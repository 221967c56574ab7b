"""The command ``python -m skorch_accel_callbacks`` (``skorch-accel-callbacks``).

``list DIR``, ``verify DIR [NAME]`` and ``export DIR [NAME] OUT``: what is
in a folder of checkpoints, whether its files are intact, and a checkpoint's
model(s) as files for inference. Each also takes the URL of checkpoints in
an object store (``s3://bucket/run1``; ``verify`` and ``export`` download
into a temporary folder). ``list`` and ``verify`` only read the folder;
``export`` only writes into ``OUT``.

Exit codes, the same for every command: 0 done (``verify``: intact), 1 a
checkpoint is damaged or cannot be used (``list`` lists it as DAMAGED,
``verify`` names each damaged file, ``export`` the model file it could not
read; ``export`` without a name refuses a damaged newest checkpoint unless
``--allow-older``) or the command failed (``OUT`` not writable), 2 a usage
error: a wrong argument (``OUT`` a file), no such
folder or checkpoint (``best`` where no checkpoint is the best one).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Collection, Sequence
from typing import Any, TextIO

from skorch_accel_callbacks._core.messages import format_bytes
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError, SkorchAccelError
from skorch_accel_callbacks.format import POINTERS, is_checkpoint_name, pointed_name, pointer_name
from skorch_accel_callbacks.storage import CheckpointStorage, open_storage
from skorch_accel_callbacks.tools import export as exporting, inspection

__all__ = ['main']

OK, DAMAGED, USAGE = 0, 1, 2


class UsageError(Exception):
    """A wrong argument, or no such folder or checkpoint (exit code 2)."""


def _open(source: str, name: str | None, local_dir: str) -> tuple[CheckpointStorage, str | None]:
    """``(storage of checkpoints, name)``: a checkpoint given as DIR
    (``DIR/epoch-0003``, a URL of one, or any folder with a manifest)
    stands for its folder and its name (its path, for a folder of another
    name); a checkpoint of a store is downloaded into ``local_dir``."""
    storage, which = exporting.open_source(source, name or 'latest', local_dir)
    return storage, (None if name is None and which == 'latest' else which)


# ---------------------------------------------------------------- list

def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ['  '.join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            .rstrip() for row in rows]


def _took(row: dict[str, Any]) -> str:
    if row['save_seconds'] is None:
        return '-'
    text = f"{row['save_seconds']:.2f} s"
    if row['blocked_seconds'] is not None:
        text += f" (blocked {row['blocked_seconds']:.2f} s)"
    return text


def _list(args: argparse.Namespace, out: TextIO) -> int:
    storage = open_storage(args.dir)
    if is_checkpoint_name(storage.dirname.rstrip('/').rpartition('/')[2]):
        raise UsageError(f"{storage.dirname} is one checkpoint: list the folder that holds "
                         f"it, or verify {storage.dirname}")
    if not storage.exists():
        raise UsageError(f"no such folder: {storage.dirname}")
    rows = inspection.describe(storage)
    _print_rows(storage.dirname, rows, out)
    print('pointers: ' + '; '.join(
        f"{pointer_name(which)} -> {storage.pointed(which) or 'none'}"
        for which in POINTERS), file=out)
    if storage.keeps_local_folder:
        # what a job leaves beside its checkpoints: a local folder's own
        _print_leftovers_and_lock(storage.dirname, out)
    return DAMAGED if any(row['problem'] for row in rows) else OK


def _print_leftovers_and_lock(dirname: str, out: TextIO) -> None:
    left = inspection.leftovers(dirname)
    print('left over:' + ('' if left else ' nothing'), file=out)
    for name, what in left:
        suffix = '/' if os.path.isdir(os.path.join(dirname, name)) else ''
        print(f"  {name}{suffix}  {what}", file=out)
    lock = inspection.lock_state(dirname)
    if not lock['exists']:
        state = 'none (no job has trained here)'
    else:
        holder = lock['holder'] or 'no job named in it'
        state = {True: f"held by a running job: {holder}",
                 False: f"free (last taken by {holder})",
                 None: f"cannot be read (last taken by {holder})"}[lock['held']]
    print(f"lock: {state}", file=out)


def _print_rows(dirname: str, rows: list[dict[str, Any]], out: TextIO) -> None:
    print(f"{dirname}: {len(rows)} checkpoint(s), in training order", file=out)
    if rows:
        table = [('name', 'epoch', 'step', 'best', 'score', 'finished', 'world', 'size',
                  'saved (UTC)', 'took', 'state')]
        for row in rows:
            score = f"{row['score'][0]} {row['score'][1]:.4f}" if row['score'] else '-'
            finished = ('stopped' if row['stopped_early'] else
                        'yes' if row['finished'] else 'no')
            saved_at = (row['saved_at'].strftime('%Y-%m-%d %H:%M:%S')
                        if row['saved_at'] else '-')
            table.append((
                row['name'], str(row['epoch'] if row['epoch'] is not None else '-'),
                str(row['step'] if row['step'] is not None else '-'),
                'best' if row['best'] else '-', score, finished,
                str(row['world_size'] if row['world_size'] is not None else '-'),
                format_bytes(row['bytes']) if row['bytes'] is not None else '-', saved_at,
                _took(row),
                'DAMAGED' if row['problem'] else 'ok'))
        for line in _table(table):
            print('  ' + line, file=out)
        for row in rows:
            if row['problem']:
                print(f"  {row['name']} is DAMAGED: {row['problem']}", file=out)
        print("  (state: the manifest, and the size and checksum of every file; verify "
              "loads every file)",
              file=out)


# ---------------------------------------------------------------- verify

def _pointer_problems(storage: CheckpointStorage,
                      names: Collection[str]) -> tuple[list[str], list[str]]:
    """(damaged, notes) about latest.json and best.json."""
    damaged, notes = [], []
    for which in POINTERS:
        file = storage.url(pointer_name(which))
        try:
            name = pointed_name(storage.read_json(pointer_name(which)))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            name = None
        if name is None:
            problem = f"{file} cannot be read or names no checkpoint"
        elif name not in names:
            problem = f"{file} names {name}, which is not in {storage.dirname}"
        else:
            continue
        if which == 'best':
            damaged.append(problem + ": resume='best' fails")
        else:
            notes.append(problem + ": resuming takes the newest complete checkpoint")
    return damaged, notes


def _print_verdict(where: str, verdict: inspection.Verdict, out: TextIO) -> None:
    if verdict.intact:
        print(f"{where}: intact ({verdict.files} files, {format_bytes(verdict.bytes)})",
              file=out)
    else:
        print(f"{where}: DAMAGED", file=out)
        for line in verdict.damaged:
            print(f"  {line}", file=out)
    for line in verdict.notes:
        print(f"  note: {line}", file=out)


def _verify(args: argparse.Namespace, out: TextIO) -> int:
    # a checkpoint of a store is downloaded into a temporary folder
    with tempfile.TemporaryDirectory(prefix='skorch-accel-verify-') as staging:
        storage, name = _open(args.dir, args.name, staging)
        names = storage.committed()
        damaged, notes = [], []
        if name is None:
            if not names:
                raise UsageError(f"no checkpoints in {storage.dirname}")
            targets = names
            damaged, notes = _pointer_problems(storage, names)
        elif name in POINTERS or is_checkpoint_name(name):
            targets = [storage.named(name, names)]  # FileNotFoundError: there is none
        elif os.path.isdir(name):
            targets = [name]  # a folder given as a checkpoint (renamed, copied)
        else:
            raise UsageError(f"NAME must be a checkpoint name (epoch-NNNN), 'latest' or "
                             f"'best', got {name!r}")
        bad = 0
        for target in targets:
            where, verdict = _verify_one(storage, target)
            bad += not verdict.intact
            _print_verdict(where, verdict, out)
    for line in damaged:
        print(f"DAMAGED: {line}", file=out)
    for line in notes:
        print(f"note: {line}", file=out)
    if len(targets) > 1:
        print(f"{len(targets)} checkpoints: {len(targets) - bad} intact, {bad} damaged",
              file=out)
    return DAMAGED if bad or damaged else OK


def _verify_one(storage: CheckpointStorage, target: str) -> tuple[str, inspection.Verdict]:
    """Where checkpoint ``target`` (a name of ``storage``, or a folder) is,
    and what :func:`inspection.verify` says of its local copy; one of a
    store that is not downloaded whole is damaged by what stopped it."""
    if not is_checkpoint_name(target):
        return target, inspection.verify(target)
    where = storage.url(target)
    if not (storage.keeps_local_folder or os.path.isdir(storage.path(target))):
        try:
            storage.fetch(target)
        except CorruptCheckpointError as exc:
            verdict = inspection.Verdict(where)
            verdict.damaged.append(str(exc))
            return where, verdict
    return where, inspection.verify(storage.path(target))


# ---------------------------------------------------------------- export

def _export(args: argparse.Namespace, out: TextIO) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            source, files = _export_from(args.dir, args.name, args.out, args.allow_older)
        finally:
            # export warns again about the checkpoint it was given
            for message in dict.fromkeys(str(warning.message) for warning in caught):
                print(f"warning: {message}", file=sys.stderr)
    print(f"exported the model(s) of {source} into {args.out}:", file=out)
    for key, file in files.items():
        print(f"  {file}  ({key})", file=out)
    arguments = ', '.join(f"{key}={file!r}" for key, file in files.items())
    print(f"load them with net.load_params({arguments}, use_safetensors=True)", file=out)
    return OK


def _export_from(source: str, name: str | None, out_dir: str,
                 allow_older: bool) -> tuple[str, dict[str, str]]:
    """Export checkpoint ``name`` of ``source`` (one of a store downloaded
    into a temporary folder, exported, and removed); where it was and the
    files written. Without a name, the newest checkpoint, or with
    ``allow_older`` the newest that can be exported."""
    with tempfile.TemporaryDirectory(prefix='skorch-accel-export-') as staging:
        storage, which = _open(source, name, staging)
        which = which or 'latest'
        if which == 'best':
            # a usage error, not the CheckpointError of a folder without a best one
            storage.named(which)
        path = exporting.find_exportable(storage.dirname, which, staging)
        newest = next(iter(storage.newest_first()), None) if which == 'latest' else None
        if newest is not None and os.path.basename(path) != newest and not allow_older:
            raise CheckpointError(
                f"the newest checkpoint, {storage.url(newest)}, cannot be exported (see the "
                f"warning above); the newest that can is {os.path.basename(path)}: name it, "
                "or pass --allow-older to take it")
        files = exporting.export(path, out=out_dir)
    return storage.url(os.path.basename(path)), files


# ---------------------------------------------------------------- main

def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="List, verify and export the checkpoints of AccelerateCheckpoint. "
                    "list and verify only read the folder.",
        epilog="Exit codes, the same for every command: 0 done (verify: intact); 1 a "
               "checkpoint is damaged or cannot be used, or the command failed; 2 a "
               "usage error: a wrong argument (export: OUT is a file), no such folder "
               "or checkpoint (best where none is the best one).")
    commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    _add_list(commands)
    _add_verify(commands)
    _add_export(commands)
    return parser


def _add_list(commands: Any) -> None:
    listing = commands.add_parser(
        'list', help="the checkpoints of a folder, what is left over and its lock",
        description="One line a checkpoint, in training order: name, epochs done, "
                    "optimizer steps, best, the "
                    "last epoch's valid_loss (or train_loss), finished, world size, size "
                    "on disk, when it was saved, how long the save took; then the "
                    "pointers, what killed jobs left over and the folder's lock.")
    listing.add_argument('dir', metavar='DIR', help="an AccelerateCheckpoint's dirname")
    listing.set_defaults(run=_list)


def _add_verify(commands: Any) -> None:
    verifying = commands.add_parser(
        'verify', help="check that every file of the checkpoints loads",
        description="Check the manifest, the size of every file and that every file "
                    "loads without running code (safetensors, JSON, "
                    "torch.load(weights_only=True)). Exit 0 if intact, 1 if damaged "
                    "(each damaged file is named), 2 for a usage error (no such "
                    "folder or checkpoint, no best one).")
    verifying.add_argument('dir', metavar='DIR',
                           help="an AccelerateCheckpoint's dirname, or one checkpoint folder")
    verifying.add_argument('name', metavar='NAME', nargs='?',
                           help="one checkpoint: epoch-NNNN, or latest / best (what "
                                "latest.json / best.json name); default: all of them")
    verifying.set_defaults(run=_verify)


def _add_export(commands: Any) -> None:
    exporting_ = commands.add_parser(
        'export', help="a checkpoint's model(s) as safetensors files for load_params",
        description="Write the model(s) of a checkpoint into OUT as "
                    "params.safetensors (the module), <name>.safetensors (other "
                    "modules and criteria) and history.json, which skorch's "
                    "net.load_params(f_params=..., use_safetensors=True) reads. A "
                    "checkpoint whose model files are intact is exported even if an "
                    "optimizer or random-state file is missing (a warning names it). "
                    "Exit 0 if exported, 1 if a model file is damaged (without NAME: "
                    "the newest checkpoint's, unless --allow-older), 2 for a usage "
                    "error (no such folder or checkpoint, no best one, OUT a file).")
    exporting_.add_argument('dir', metavar='DIR',
                            help="an AccelerateCheckpoint's dirname, or one checkpoint folder")
    exporting_.add_argument('name', metavar='NAME', nargs='?',
                            help="latest (default: the newest complete checkpoint), best, "
                                 "or epoch-NNNN")
    exporting_.add_argument('out', metavar='OUT',
                            help="the folder to write into (created if needed; files of "
                                 "an earlier export are replaced)")
    exporting_.add_argument('--allow-older', action='store_true',
                            help="without NAME, where the newest checkpoint is damaged, "
                                 "export the newest one that is not (by default a "
                                 "damaged newest checkpoint is an error, exit 1)")
    exporting_.set_defaults(run=_export)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); return the
    exit code."""
    args = _parser(prog).parse_args(argv)
    try:
        return args.run(args, sys.stdout)
    # a missing folder is a usage error; every error of the package's own
    # (a damaged checkpoint, a store out of reach) and of the system's is one
    # of what was read
    except (UsageError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return USAGE
    except (SkorchAccelError, OSError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return DAMAGED
    except ValueError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return USAGE

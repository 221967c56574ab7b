"""A checkpoint beyond its own run: its model in any net (``load_params``,
``export``), the command ``python -m skorch_accel_callbacks`` (list, verify,
export), what a save reports, and the back-ends that are refused.

The command runs as a user runs it: in a subprocess, its exit code and
output checked. Training runs in this process (one process) or through the
tests' launcher (two).
"""

import json
import os
import re
from datetime import UTC, datetime

import numpy as np
import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from skorch import NeuralNetClassifier

from common import MLP, Snapshot, log_nll, make_accelerator, make_data, make_net, plain_net
from launcher import REPO
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    CorruptCheckpointError,
)
from skorch_accel_callbacks._core import accelerate_io, releases
from skorch_accel_callbacks._core.messages import format_bytes
from skorch_accel_callbacks._core.wrapping import is_wrapped
from skorch_accel_callbacks.storage._lock import FolderLock
from skorch_accel_callbacks.tools.export import export
from testutil import cli

# plain_net(batch_size=32): a net that loads a checkpoint predicts in batches of
# the trained net's size, the same batches, the same floats


def best_until_2(net):
    return len(net.history) <= 2


def train(dirname, max_epochs=3, **cp_kwargs):
    """A 1-process accelerated net trained with AccelerateCheckpoint."""
    messages = []
    cp = AccelerateCheckpoint(dirname=str(dirname), sink=messages.append, **cp_kwargs)
    snapshot = Snapshot()
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[cp, snapshot], max_epochs=max_epochs)
    X, y = make_data(n=160)
    began = datetime.now(UTC)
    net.fit(X, y)
    return dict(net=net, X=X, y=y, dirname=str(dirname), messages=messages,
                params=snapshot.params_, began=began, ended=datetime.now(UTC))


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """3 epochs: 1 and 2 saved because of the monitor (best.json names 2),
    3 when training ended (finished, latest.json)."""
    return train(tmp_path_factory.mktemp('trained') / 'ck', monitor=best_until_2, keep_last=3)


def assert_params(net, expected):
    module = net.accelerator.unwrap_model(net.module_) if hasattr(net, 'accelerator') \
        else net.module_
    state = module.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def tree(path):
    """Every file and folder below ``path`` with its size, mtime and mode:
    what a command that only reads must leave as it was."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files + ['.']:
            full = os.path.join(root, name)
            info = os.lstat(full)
            found[os.path.relpath(full, path)] = (info.st_size, info.st_mtime_ns, info.st_mode)
    return found


def copy_folder(src, dst):
    """A copy of a folder of checkpoints, the manifests' times kept."""
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def flip_header_byte(file):
    """Damage a safetensors file without changing its size: the first byte
    of its JSON header (after the 8-byte length) becomes invalid UTF-8."""
    data = bytearray(open(file, 'rb').read())
    assert data[8:9] == b'{'
    data[8] = 0xff
    open(file, 'wb').write(bytes(data))


# ---------------------------------------------------------------- load_params

def test_plain_net_loads_the_newest_checkpoint(trained):
    """A script without accelerate: a new callback on the folder, no fit."""
    net = plain_net(batch_size=32).initialize()
    net.load_params(checkpoint=AccelerateCheckpoint(dirname=trained['dirname']))
    assert_params(net, trained['params'][3])
    np.testing.assert_array_equal(net.predict_proba(trained['X']),
                                  trained['net'].predict_proba(trained['X']))
    # the history of the checkpoint came with it
    assert len(net.history) == 3
    assert net.history[-1, 'valid_loss'] == trained['net'].history[-1, 'valid_loss']
    # where torch.load reads the safetensors files, they are handed over as
    # they are, which skorch also reads with use_safetensors=True (with an
    # older torch they come in torch's format: test_releases)
    if releases.torch_loads_safetensors():
        again = plain_net(batch_size=32).initialize()
        again.load_params(checkpoint=AccelerateCheckpoint(dirname=trained['dirname']),
                          use_safetensors=True)
        assert_params(again, trained['params'][3])


@pytest.mark.parametrize('which', ['best', 'epoch-0002', 'path'])
def test_which_checkpoint(trained, which):
    cp = AccelerateCheckpoint(dirname=trained['dirname'])
    if which == 'path':
        which = os.path.join(trained['dirname'], 'epoch-0002')
    net = plain_net(batch_size=32).initialize()
    net.load_params(**cp.get_formatted_files(net, which=which))
    assert_params(net, trained['params'][2])
    assert len(net.history) == 2


def test_accelerated_nets_wrapped_and_unwrapped_load_it(trained):
    accelerator = trained['net'].accelerator
    wrapped = make_net(accelerator).initialize()
    assert is_wrapped(wrapped)
    wrapped.load_params(checkpoint=AccelerateCheckpoint(dirname=trained['dirname']))
    assert is_wrapped(wrapped)
    assert_params(wrapped, trained['params'][3])

    bare = make_net(accelerator, max_epochs=1)
    bare.fit(trained['X'], trained['y'])  # skorch unwraps after training
    assert not is_wrapped(bare)
    bare.load_params(checkpoint=AccelerateCheckpoint(dirname=trained['dirname']))
    assert_params(bare, trained['params'][3])
    np.testing.assert_array_equal(bare.predict_proba(trained['X']),
                                  trained['net'].predict_proba(trained['X']))


def test_no_checkpoint_and_damaged_checkpoint_name_the_folder_and_file(tmp_path, trained):
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint in {empty}")):
        plain_net(batch_size=32).initialize().load_params(checkpoint=AccelerateCheckpoint(dirname=str(empty)))
    with pytest.raises(FileNotFoundError, match="no checkpoint epoch-0009 in"):
        AccelerateCheckpoint(dirname=trained['dirname']).get_formatted_files(
            None, which='epoch-0009')
    folder = copy_folder(trained['dirname'], tmp_path / 'ck')
    model = os.path.join(folder, 'epoch-0002', 'model.safetensors')
    with open(model, 'r+b') as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=re.escape(model)):
        plain_net(batch_size=32).initialize().load_params(**AccelerateCheckpoint(dirname=folder).get_formatted_files(
            None, which='best'))


class ScaledNLL(torch.nn.Module):
    """A criterion with a trainable parameter: accelerate saves it as a
    second model, ``model_1.safetensors``."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 1.5]))

    def forward(self, y_pred, y):
        return log_nll(y_pred, y) * torch.nn.functional.softplus(self.scale).sum()


def test_export_writes_skorch_files_for_each_model(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    torch.manual_seed(0)
    net = make_net(make_accelerator(), criterion=ScaledNLL, callbacks=[cp], max_epochs=2)
    net.fit(*make_data(n=160))
    saved = json.loads((tmp_path / 'ck' / 'epoch-0002' / 'manifest.json').read_text())
    # accelerate's order: skorch prepares the criterion first, in model.safetensors
    assert [name for name, _ in saved['models']] == ['criterion', 'module']
    assert {'model.safetensors', 'model_1.safetensors'} <= set(saved['files'])

    files = export(tmp_path / 'ck', out=tmp_path / 'out')
    out = str(tmp_path / 'out')
    assert files == {'f_params': os.path.join(out, 'params.safetensors'),
                     'f_criterion': os.path.join(out, 'criterion.safetensors'),
                     'f_history': os.path.join(out, 'history.json')}
    assert sorted(os.listdir(out)) == ['criterion.safetensors', 'history.json',
                                       'params.safetensors']
    plain = NeuralNetClassifier(MLP, criterion=ScaledNLL, batch_size=32).initialize()
    plain.load_params(**files, use_safetensors=True)
    assert torch.equal(plain.criterion_.scale, net.criterion_.scale.detach())
    assert not torch.equal(plain.criterion_.scale, ScaledNLL().scale.detach())
    assert_params(plain, {k: v.detach() for k, v in net.module_.state_dict().items()})
    # the callback gives load_params the same files, from the checkpoint
    via_cp = NeuralNetClassifier(MLP, criterion=ScaledNLL).initialize()
    via_cp.load_params(checkpoint=cp)
    assert torch.equal(via_cp.criterion_.scale, net.criterion_.scale.detach())


def test_export_refuses_to_write_into_the_checkpoint(trained):
    folder = os.path.join(trained['dirname'], 'epoch-0003')
    with pytest.raises(ValueError, match='inside the checkpoint'):
        export(folder, out=os.path.join(folder, 'exported'))
    assert not os.path.exists(os.path.join(folder, 'exported'))


# ---------------------------------------------------------------- what a save says

def test_manifest_records_time_bytes_duration_and_the_message_says_them(trained):
    for epoch in (1, 2, 3):
        folder = os.path.join(trained['dirname'], f'epoch-{epoch:04d}')
        saved = json.loads(open(os.path.join(folder, 'manifest.json')).read())
        assert saved['bytes'] == sum(saved['files'].values())
        assert saved['bytes'] == sum(os.path.getsize(os.path.join(folder, rel))
                                     for rel in saved['files'])
        saved_at = datetime.fromisoformat(saved['saved_at'])
        assert saved_at.utcoffset().total_seconds() == 0
        assert trained['began'] <= saved_at <= trained['ended']
        assert 0 < saved['save_seconds'] < (trained['ended'] - trained['began']).total_seconds()
        assert 'blocked_seconds' not in saved
        message = trained['messages'][epoch - 1]
        finished = ' (finished)' if epoch == 3 else ''
        assert message == (f"Saved checkpoint {folder}{finished}: "
                           f"{format_bytes(saved['bytes'])} in {saved['save_seconds']:.2f} s")


def test_async_save_says_how_long_training_was_blocked(tmp_path):
    run = train(tmp_path / 'ck', max_epochs=2, async_save=True)
    assert len(run['messages']) == 2
    for epoch, message in enumerate(run['messages'], 1):
        folder = os.path.join(run['dirname'], f'epoch-{epoch:04d}')
        saved = json.loads(open(os.path.join(folder, 'manifest.json')).read())
        assert saved['bytes'] == sum(saved['files'].values())
        assert 0 <= saved['blocked_seconds'] < (run['ended'] - run['began']).total_seconds()
        finished = ' (finished)' if epoch == 2 else ''
        assert message == (f"Saved checkpoint {folder}{finished}: "
                           f"{format_bytes(saved['bytes'])} in "
                           f"{saved['save_seconds']:.2f} s, training blocked "
                           f"{saved['blocked_seconds']:.2f} s")


# ---------------------------------------------------------------- back-ends

@pytest.fixture
def accelerator():
    accelerator = make_accelerator()
    original = accelerator.state.distributed_type
    yield accelerator
    accelerator.state.distributed_type = original


@pytest.mark.parametrize('kind', list(DistributedType), ids=lambda kind: kind.value)
def test_check_plain_state_refuses_exactly_the_sharding_back_ends(accelerator, kind):
    """Every distributed type accelerate 1.15 knows, set on a real Accelerator."""
    accelerator.state.distributed_type = kind
    assert accelerator.distributed_type == kind
    plugins = {'FSDP': 'FullyShardedDataParallelPlugin', 'DEEPSPEED': 'DeepSpeedPlugin',
               'MEGATRON_LM': 'MegatronLMPlugin', 'XLA': 'TPU'}
    if kind.value in plugins:
        with pytest.raises(ValueError) as info:
            accelerate_io.check_plain_state(accelerator, 'AccelerateCheckpoint')
        assert str(info.value).startswith(
            f"AccelerateCheckpoint does not support accelerate's {kind.value} back-end "
            f"({plugins[kind.value]})")
        assert 'Supported are one process and DistributedDataParallel' in str(info.value)
    else:
        accelerate_io.check_plain_state(accelerator, 'AccelerateCheckpoint')


@pytest.mark.parametrize('kind', [DistributedType.FSDP, DistributedType.DEEPSPEED])
@pytest.mark.parametrize('callbacks', ['checkpoint', 'async', 'resume'])
def test_training_under_fsdp_or_deepspeed_fails_naming_it(tmp_path, accelerator, kind,
                                                          callbacks):
    """The net is prepared as usual, then the accelerator reports the
    back-end (FSDP needs GPUs to be selected for real): the callbacks refuse
    it when training begins, before they look at the modules, the folder or a
    checkpoint."""
    dirname = tmp_path / 'ck'
    if callbacks == 'resume':
        # a checkpoint is there to resume from
        train(dirname, max_epochs=1)
        accelerator = make_accelerator()
    before = tree(tmp_path)
    cp = AccelerateCheckpoint(dirname=str(dirname), async_save=callbacks == 'async')
    listed = [AccelerateLoadInitState(cp), cp] if callbacks == 'resume' else [cp]
    net = make_net(accelerator, callbacks=listed, max_epochs=2).initialize()
    accelerator.state.distributed_type = kind
    with pytest.raises(ValueError) as info:
        net.partial_fit(*make_data(n=160))
    assert not isinstance(info.value, CheckpointError)
    who = {'checkpoint': 'AccelerateCheckpoint', 'async': 'AccelerateCheckpoint(async_save=True)',
           'resume': 'AccelerateLoadInitState'}[callbacks]
    assert str(info.value).startswith(
        f"{who} does not support accelerate's {kind.value} back-end")
    assert len(net.history) == 0
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- the command

@pytest.mark.slow
def test_list_shows_each_checkpoint_leftovers_and_the_lock(tmp_path, trained):
    folder = copy_folder(trained['dirname'], tmp_path / 'ck')
    os.mkdir(os.path.join(folder, 'epoch-0004.partial'))
    open(os.path.join(folder, '.latest.json.tmp-0123456789ab'), 'w').close()
    # a manifest written before saved_at, bytes and save_seconds existed
    old = os.path.join(folder, 'epoch-0001', 'manifest.json')
    saved = json.loads(open(old).read())
    for key in ('saved_at', 'bytes', 'save_seconds'):
        del saved[key]
    open(old, 'w').write(json.dumps(saved))
    os.utime(old, (0, 0))  # 1970: still the first in training order
    before = tree(folder)

    proc = cli('list', folder)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{folder}: 3 checkpoint(s), in training order"
    assert lines[1].split() == ['name', 'epoch', 'step', 'best', 'score', 'finished', 'world',
                                'size', 'saved', '(UTC)', 'took', 'state']
    rows = [line.split() for line in lines[2:5]]
    steps = [json.loads(open(os.path.join(folder, f'epoch-{epoch:04d}', 'manifest.json')).read())
             ['position']['step'] for epoch in (1, 2, 3)]
    # the steps column is the manifest's; each row is one step column to the right
    assert [row[2] for row in rows] == [str(step) for step in steps] and steps[0] > 0
    rows = [row[:2] + row[3:] for row in rows]
    assert [row[:3] for row in rows] == [['epoch-0001', '1', 'best'],
                                         ['epoch-0002', '2', 'best'], ['epoch-0003', '3', '-']]
    for row, epoch in zip(rows, (1, 2, 3), strict=True):
        valid_loss = trained['net'].history[epoch - 1, 'valid_loss']
        finished = 'yes' if epoch == 3 else 'no'
        assert row[3:7] == ['valid_loss', f"{valid_loss:.4f}", finished, '1']
        # the files the manifest lists (epoch 1's has no 'bytes'), not itself
        listed = json.loads(open(os.path.join(folder, f'epoch-{epoch:04d}', 'manifest.json'))
                            .read())['files']
        assert ' '.join(row[7:9]) == format_bytes(sum(listed.values()))
        assert row[-1] == 'ok'
    assert rows[0][9:12] == ['1970-01-01', '00:00:00', '-']
    saved_at = datetime.fromisoformat(json.loads(open(os.path.join(
        folder, 'epoch-0003', 'manifest.json')).read())['saved_at'])
    assert rows[2][9:11] == saved_at.strftime('%Y-%m-%d %H:%M:%S').split()
    assert re.fullmatch(r'\d+\.\d\d', rows[2][11]) and rows[2][12] == 's'
    rest = proc.stdout.split('\n', 5)[5]
    assert 'pointers: latest.json -> epoch-0003; best.json -> epoch-0002' in rest
    assert '.latest.json.tmp-0123456789ab  temporary or half-removed file' in rest
    assert 'epoch-0004.partial/  partial checkpoint' in rest
    assert f"lock: free (last taken by pid {os.getpid()} on host" in rest
    assert tree(folder) == before

    # a job holds the folder
    lock = FolderLock(folder).acquire()
    try:
        held = cli('list', folder)
    finally:
        lock.release()
    assert held.returncode == 0, held.stderr
    assert f"lock: held by a running job: pid {os.getpid()} on host" in held.stdout


@pytest.mark.slow
def test_list_verify_and_the_save_message_say_one_size(trained):
    """The size of a checkpoint is the manifest's ``bytes``, the files it
    lists (the manifest not counted): the save message, ``list`` and
    ``verify`` say the same."""
    listed = cli('list', trained['dirname'])
    verified = cli('verify', trained['dirname'])
    assert listed.returncode == verified.returncode == 0, listed.stderr + verified.stderr
    for epoch, message in zip((1, 2, 3), trained['messages'], strict=True):
        name = f'epoch-{epoch:04d}'
        saved = json.loads(open(os.path.join(trained['dirname'], name, 'manifest.json')).read())
        size = format_bytes(saved['bytes'])
        assert f": {size} in " in message
        row = next(line.split() for line in listed.stdout.splitlines()
                   if line.split()[:1] == [name])
        assert ' '.join(row[8:10]) == size
        assert (f"{trained['dirname']}/{name}: intact ({len(saved['files'])} files, {size})"
                in verified.stdout)
    # counting the manifest too would show: it is more than a rounding error
    folder = os.path.join(trained['dirname'], 'epoch-0003')
    on_disk = sum(os.path.getsize(os.path.join(folder, rel)) for rel in os.listdir(folder))
    assert format_bytes(on_disk) != format_bytes(saved['bytes'])


@pytest.mark.slow
def test_verify_intact_then_damaged_names_each_file(tmp_path, trained):
    folder = copy_folder(trained['dirname'], tmp_path / 'ck')
    before = tree(folder)
    intact = cli('verify', folder)
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert intact.stdout.splitlines()[-1] == "3 checkpoints: 3 intact, 0 damaged"
    for epoch in (1, 2, 3):
        assert re.search(rf"^{re.escape(folder)}/epoch-000{epoch}: intact \(\d+ files, ",
                         intact.stdout, flags=re.M)
    assert tree(folder) == before

    truncated = os.path.join(folder, 'epoch-0001', 'optimizer.bin')
    with open(truncated, 'r+b') as f:
        f.truncate(100)
    flipped = os.path.join(folder, 'epoch-0003', 'model.safetensors')
    size = os.path.getsize(flipped)
    flip_header_byte(flipped)
    assert os.path.getsize(flipped) == size  # the manifest's sizes do not show it
    before = tree(folder)
    damaged = cli('verify', folder)
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    out = damaged.stdout
    assert f"{folder}/epoch-0001: DAMAGED\n  {truncated} has 100 bytes," in out
    assert f"{folder}/epoch-0002: intact" in out
    assert (f"{folder}/epoch-0003: DAMAGED\n  {flipped} does not load without running "
            "code: SafetensorError") in out
    assert out.splitlines()[-1] == "3 checkpoints: 1 intact, 2 damaged"
    assert tree(folder) == before
    # list says so by its exit code too
    listed = cli('list', folder)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    assert "epoch-0001 is DAMAGED" in listed.stdout
    assert tree(folder) == before

    one = cli('verify', folder, 'epoch-0002')
    assert one.returncode == 0 and one.stdout.startswith(f"{folder}/epoch-0002: intact")
    latest = cli('verify', os.path.join(folder, 'epoch-0003'))
    assert latest.returncode == 1 and flipped in latest.stdout
    # a checkpoint copied elsewhere under another name is still one
    kept = tmp_path / 'kept'
    os.rename(os.path.join(folder, 'epoch-0002'), kept)
    renamed = cli('verify', kept)
    assert renamed.returncode == 0 and renamed.stdout.startswith(f"{kept}: intact ("), \
        renamed.stdout + renamed.stderr


@pytest.mark.slow
def test_verify_and_list_usage_errors_exit_2(tmp_path, trained):
    missing = tmp_path / 'nowhere'
    proc = cli('verify', missing)
    assert (proc.returncode, proc.stderr) == (2, f"verify: no such folder: {missing}\n")
    proc = cli('verify', trained['dirname'], 'epoch-0009')
    assert proc.returncode == 2 and 'no checkpoint epoch-0009 in' in proc.stderr
    proc = cli('list', missing)
    assert (proc.returncode, proc.stderr) == (2, f"list: no such folder: {missing}\n")
    proc = cli('frobnicate', trained['dirname'])
    assert proc.returncode == 2 and 'invalid choice' in proc.stderr


@pytest.mark.slow
def test_export_command_then_load_params(tmp_path, trained):
    out = tmp_path / 'model'
    proc = cli('export', trained['dirname'], 'best', out)
    assert proc.returncode == 0, proc.stderr
    assert f"exported the model(s) of {trained['dirname']}/epoch-0002 into {out}" in proc.stdout
    params = os.path.join(out, 'params.safetensors')
    assert (f"load them with net.load_params(f_params={params!r}, "
            f"f_history={os.path.join(out, 'history.json')!r}, use_safetensors=True)"
            in proc.stdout)
    net = plain_net(batch_size=32).initialize()
    net.load_params(f_params=params, use_safetensors=True)
    assert_params(net, trained['params'][2])

    damaged = copy_folder(trained['dirname'], tmp_path / 'ck')
    model = os.path.join(damaged, 'epoch-0003', 'model.safetensors')
    flip_header_byte(model)
    # its checksum tells: without a name a damaged newest checkpoint is
    # refused, naming the one that could be taken; --allow-older takes it,
    # as a resume does; a name refuses it
    proc = cli('export', damaged, tmp_path / 'out1')
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{model} has checksum" in proc.stderr
    assert (f"export: the newest checkpoint, {damaged}/epoch-0003, cannot be exported (see "
            "the warning above); the newest that can is epoch-0002: name it, or pass "
            "--allow-older to take it") in proc.stderr
    assert not (tmp_path / 'out1').exists()
    proc = cli('export', damaged, tmp_path / 'out2', '--allow-older')
    assert proc.returncode == 0, proc.stderr
    assert f"{model} has checksum" in proc.stderr
    assert f"exported the model(s) of {damaged}/epoch-0002 into" in proc.stdout
    proc = cli('export', damaged, 'epoch-0003', tmp_path / 'out3')
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"export: {model} has checksum"), proc.stderr
    assert not (tmp_path / 'out3').exists()


@pytest.mark.slow
def test_no_best_checkpoint_is_a_usage_error_for_verify_and_export(tmp_path):
    """A folder saved without ``monitor`` has no best checkpoint: both
    commands exit 2 and say so; export writes nothing."""
    run = train(tmp_path / 'ck', max_epochs=1)
    for command in (('verify', run['dirname'], 'best'),
                    ('export', run['dirname'], 'best', tmp_path / 'out')):
        proc = cli(*command)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr == (
            f"{command[0]}: no best checkpoint in {run['dirname']}: there is no "
            f"{run['dirname']}/best.json: only checkpoints saved because of `monitor` are "
            "best ones\n")
    assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_export_into_a_file_names_it_and_exits_2(tmp_path, trained):
    target = tmp_path / 'model.safetensors'
    target.write_bytes(b'mine')
    proc = cli('export', trained['dirname'], target)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"export: {target} exists and is not a folder: export into a new "
                           "folder, or one an earlier export wrote\n")
    assert target.read_bytes() == b'mine'
    with pytest.raises(FileExistsError, match=re.escape(f"{target} exists and is not a folder")):
        export(trained['dirname'], out=target)


@pytest.mark.slow
def test_export_a_checkpoint_missing_a_random_state_file_warns_and_exports(tmp_path, trained):
    """The newest checkpoint lacks its random states: it cannot be resumed
    from (verify says so), but its model is intact and is the one exported,
    by name and as the latest, with a warning naming the missing file."""
    folder = copy_folder(trained['dirname'], tmp_path / 'ck')
    missing = os.path.join(folder, 'epoch-0003', 'random_states_0.pkl')
    os.remove(missing)
    verified = cli('verify', folder, 'epoch-0003')
    assert verified.returncode == 1
    assert f"{missing} is missing (listed in " in verified.stdout
    for args in ((), ('epoch-0003',), ('latest',)):
        out = tmp_path / f"out{'-'.join(args)}"
        proc = cli('export', folder, *args, out)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"exported the model(s) of {folder}/epoch-0003 into {out}" in proc.stdout
        warnings = [line for line in proc.stderr.splitlines() if line.startswith('warning: ')]
        assert len(warnings) == 1, proc.stderr
        assert warnings[0] == (
            f"warning: {folder}/epoch-0003 is not a complete checkpoint, it cannot be resumed "
            f"from: {missing} is missing (listed in {folder}/epoch-0003/manifest.json); its "
            "model files and history are intact and are exported")
        net = plain_net(batch_size=32).initialize()
        net.load_params(f_params=out / 'params.safetensors', use_safetensors=True)
        assert_params(net, trained['params'][3])
    with pytest.warns(UserWarning, match=re.escape(f"{missing} is missing")):
        files = export(folder, out=tmp_path / 'api')
    assert load_file(files['f_params']).keys() == trained['params'][3].keys()


def test_export_refuses_a_checkpoint_whose_model_file_is_missing(tmp_path, trained):
    folder = copy_folder(trained['dirname'], tmp_path / 'ck')
    model = os.path.join(folder, 'epoch-0002', 'model.safetensors')
    os.remove(os.path.join(folder, 'epoch-0002', 'random_states_0.pkl'))
    os.remove(model)
    proc = cli('export', folder, 'best', tmp_path / 'out')
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == (f"export: {model} is missing (listed in "
                           f"{folder}/epoch-0002/manifest.json)\n")
    assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_help_documents_the_exit_codes():
    proc = cli('--help')
    assert proc.returncode == 0
    text = ' '.join(proc.stdout.split())
    assert ("Exit codes, the same for every command: 0 done (verify: intact); 1 a checkpoint "
            "is damaged or cannot be used, or the command failed; 2 a usage error") in text


def test_console_script_is_declared():
    from configparser import ConfigParser

    from skorch_accel_callbacks.tools import cli as cli_module
    config = ConfigParser()
    config.read(REPO / 'setup.cfg')
    scripts = config['options.entry_points']['console_scripts'].split()
    assert scripts == ['skorch-accel-callbacks', '=', 'skorch_accel_callbacks.tools.cli:main']
    assert callable(cli_module.main)


# ---------------------------------------------------------------- 2 processes

@pytest.mark.slow
def test_checkpoint_of_two_processes_in_every_kind_of_net(tmp_path, run_workers):
    dirname = str(tmp_path / 'ck')
    results = run_workers('inspect_export.py', 'load', nproc=2, args=[dirname])
    assert [r['num_processes'] for r in results] == [2, 2]
    expected = results[0]['trained']
    for result in results:
        assert result['wrapped_type'] == 'DistributedDataParallel'
        assert result['wrapped_type_after'] == 'DistributedDataParallel'
        assert result['bare_type'] == 'MLP'
        assert result['trained'] == expected
        assert result['wrapped'] == expected
        assert result['bare'] == expected
        assert result['history_len'] == 3
        assert not any(key.startswith('module.') for key in result['wrapped_keys'])
    saved = json.loads(open(os.path.join(dirname, 'epoch-0003', 'manifest.json')).read())
    assert saved['world_size'] == 2
    assert {'random_states_0.pkl', 'random_states_1.pkl'} <= set(saved['files'])

    # without accelerate, in this one process
    net = plain_net(batch_size=32).initialize()
    net.load_params(checkpoint=AccelerateCheckpoint(dirname=dirname))
    np.testing.assert_array_equal(net.predict_proba(make_data(n=160)[0]),
                                  np.array(expected, dtype=np.float32))
    out = tmp_path / 'model'
    proc = cli('export', dirname, out)
    assert proc.returncode == 0, proc.stderr
    exported = load_file(os.path.join(out, 'params.safetensors'))
    for key, value in net.module_.state_dict().items():
        assert torch.equal(exported[key], value), key
    listed = cli('list', dirname)
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if 'epoch-0003' in line)
    # epoch 3, the last, was saved at its end marked finished
    assert row[1] == '3' and row[6] == 'yes' and row[7] == '2'


def test_format_bytes():
    """The sizes the messages and the command print."""
    assert [format_bytes(n) for n in (0, 1023, 1024, 30822, 5 * 2**20, 3 * 2**30)] == [
        '0 B', '1023 B', '1.0 KiB', '30.1 KiB', '5.0 MiB', '3.0 GiB']

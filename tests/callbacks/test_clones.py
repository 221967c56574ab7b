"""sklearn's clones: the loader resumes the net's own checkpoint.

``sklearn.base.clone`` clones each callback of the net's list apart, so a
clone's ``AccelerateLoadInitState`` holds a copy of the checkpoint that is
not the net's, and ``set_params(callbacks__<name>__dirname=...)`` changes the
net's copy only. Before, such a clone "resumed" from the original's finished
run and trained nothing; now the loader follows the net's checkpoint, and a
loader whose checkpoint is not among the net's callbacks is refused.
"""

import pytest
import torch
from sklearn.base import clone

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError


def net_of(dirname, max_epochs=2, callbacks=None):
    cp = AccelerateCheckpoint(dirname=str(dirname))
    torch.manual_seed(0)
    return make_net(make_accelerator(), max_epochs=max_epochs,
                    callbacks=callbacks or [AccelerateLoadInitState(cp), cp])


def loader_of(net):
    return dict(net.callbacks_)['AccelerateLoadInitState']


def checkpoints(folder):
    return sorted(path.name for path in folder.glob('epoch-*'))


def test_a_clone_with_another_dirname_trains_into_its_own_folder(tmp_path):
    X, y = make_data(n=96)
    original = net_of(tmp_path / 'A').fit(X, y)
    other = clone(original).set_params(callbacks__AccelerateCheckpoint__dirname=str(tmp_path / 'B'))
    torch.manual_seed(0)
    other.fit(X, y)
    assert loader_of(other).loaded_from_ is None
    assert checkpoints(tmp_path / 'B') == ['epoch-0001', 'epoch-0002']
    # trained from scratch, as the original did: the same run
    assert torch.equal(other.module_.lin.weight, original.module_.lin.weight)


def test_a_clone_of_the_same_folder_resumes_it(tmp_path):
    X, y = make_data(n=96)
    net_of(tmp_path / 'A').fit(X, y)
    again = clone(net_of(tmp_path / 'A', max_epochs=3))
    again.fit(X, y)
    assert loader_of(again).loaded_from_.endswith('epoch-0002')
    assert len(again.history) == 3


def test_a_loader_whose_checkpoint_is_not_the_net_s_is_refused(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'A'))
    net = make_net(make_accelerator(), callbacks=[AccelerateLoadInitState(cp)])
    with pytest.raises(CheckpointError) as refused:
        net.fit(*make_data(n=96))
    message = str(refused.value)
    assert f"checkpoint (dirname {str(tmp_path / 'A')!r}) is not among the net's callbacks" \
        in message
    assert 'callbacks=[AccelerateLoadInitState(cp), cp]' in message
    assert len(net.history) == 0 and not (tmp_path / 'A').exists()


def test_a_loader_of_none_of_several_checkpoints_is_refused_naming_them(tmp_path):
    elsewhere = AccelerateCheckpoint(dirname=str(tmp_path / 'X'))
    callbacks = [AccelerateLoadInitState(elsewhere),
                 ('first', AccelerateCheckpoint(dirname=str(tmp_path / 'A'))),
                 ('second', AccelerateCheckpoint(dirname=str(tmp_path / 'B')))]
    net = net_of(tmp_path, callbacks=callbacks)
    with pytest.raises(CheckpointError) as refused:
        net.fit(*make_data(n=96))
    message = str(refused.value)
    for name in 'XAB':
        assert repr(str(tmp_path / name)) in message
    assert len(net.history) == 0


# ---------------------------------------------------------------- skorch's own

def test_skorch_s_load_init_state_on_an_accelerate_checkpoint_is_refused(tmp_path):
    from skorch.callbacks import LoadInitState
    X, y = make_data(n=96)
    net_of(tmp_path / 'A').fit(X, y)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'A'))
    net = net_of(tmp_path, max_epochs=3, callbacks=[LoadInitState(cp), cp])
    with pytest.raises(CheckpointError) as refused:
        net.fit(X, y)
    message = str(refused.value)
    assert "skorch's LoadInitState ('LoadInitState')" in message
    assert 'Use AccelerateLoadInitState(cp) in its place' in message
    assert checkpoints(tmp_path / 'A') == ['epoch-0001', 'epoch-0002']


@pytest.mark.parametrize('kind', ['Checkpoint', 'TrainEndCheckpoint'])
def test_skorch_s_checkpoint_for_an_accelerate_loader_is_refused(tmp_path, kind):
    from skorch import callbacks
    skorch_cp = getattr(callbacks, kind)(dirname=str(tmp_path / 'A'))
    net = net_of(tmp_path, callbacks=[AccelerateLoadInitState(skorch_cp), skorch_cp])
    with pytest.raises(TypeError) as refused:
        net.initialize()
    message = str(refused.value)
    assert f"got skorch's {kind}" in message
    assert 'use AccelerateCheckpoint(dirname=...)' in message
    assert 'ParamsCheckpoint with LoadInitParams' in message

"""The optimizers' files, read while a checkpoint's files are checked
(engine/_read_ahead.py): what they load is what accelerate's own
``load_state`` loads; a resume begins the read for each folder it checks,
loads it only into the one it chose, drops it for one the check refuses,
and where the read failed the load reads the files itself."""

import copy
import threading

import pytest
import torch
from skorch.callbacks import Callback

from common import Counter, make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.engine import ResumeChecks, read_checkpoint
from skorch_accel_callbacks.engine._read_ahead import OptimizerReadAhead
from skorch_accel_callbacks.engine._restore import Chosen
from testutil import replace_everywhere


def prepared(seed):
    """An accelerator with a model, two optimizers (Adam and SGD with
    momentum, over its two layers), a scheduler and a custom object."""
    accelerator = make_accelerator()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    adam = torch.optim.Adam(model[0].parameters(), lr=0.01)
    sgd = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    model, adam, sgd, scheduler = accelerator.prepare(model, adam, sgd, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, (adam, sgd), scheduler, counter


def loaded(accelerator, model, optimizers, scheduler, counter):
    """What a load put into these objects (and the global random state)."""
    return {'model': copy.deepcopy(model.state_dict()),
            'optimizers': [copy.deepcopy(optimizer.state_dict()) for optimizer in optimizers],
            'scheduler': scheduler.state_dict(), 'count': counter.count,
            'rng': torch.get_rng_state(), 'step': accelerator.step}


def assert_same(left, right, where=''):
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype, where
        assert torch.equal(left, right), where
    elif isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_same(left[key], right[key], f'{where}/{key}')
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f'{where}/{index}')
    else:
        assert left == right, where


def test_a_load_of_the_states_read_ahead_loads_what_load_state_loads(tmp_path):
    accelerator, model, optimizers, scheduler, counter = prepared(0)
    for _ in range(3):
        loss = model(torch.randn(4, 6)).square().mean()
        accelerator.backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
    counter.count = 7
    accelerator.save_state(str(tmp_path))

    objects = prepared(1)
    objects[0].load_state(str(tmp_path))
    by_accelerate = loaded(*objects)

    objects = prepared(2)
    states = accelerate_io.read_optimizer_states(
        tmp_path, 2, accelerate_io.optimizer_map_location(objects[0]))
    models_when_taken = []

    def take():  # what the load sees when it takes the states
        models_when_taken.append(copy.deepcopy(objects[1].state_dict()))
        return states

    accelerate_io.load_state(objects[0], tmp_path, optimizer_states=take)
    read_ahead = loaded(*objects)

    assert_same(by_accelerate, read_ahead)
    assert by_accelerate['count'] == 7 and by_accelerate['optimizers'][0]['state']
    # the optimizers hold the tensors read ahead: no second copy
    assert (objects[2][0].state_dict()['state'][0]['exp_avg'].data_ptr()
            == states[0]['state'][0]['exp_avg'].data_ptr())
    # taken last, once the model is loaded: a read still under way when the
    # check ends finishes while the model loads
    assert_same(models_when_taken, [by_accelerate['model']])

    # a read ahead that failed hands over nothing: the files are read then
    objects = prepared(3)
    accelerate_io.load_state(objects[0], tmp_path, optimizer_states=lambda: None)
    assert_same(by_accelerate, loaded(*objects))


def test_a_read_is_handed_over_only_for_its_own_folder(tmp_path):
    accelerator, model, optimizers, scheduler, counter = prepared(0)
    for name in ('a', 'b'):
        accelerator.save_state(str(tmp_path / name))
    read_ahead = OptimizerReadAhead(accelerator)
    read_ahead.begin(tmp_path / 'a')
    assert read_ahead.take(tmp_path / 'b') is None
    read_ahead.begin(tmp_path / 'a')
    read_ahead.begin(tmp_path / 'b')  # 'a' is dropped
    assert read_ahead.take(tmp_path / 'a') is None
    read_ahead.begin(tmp_path / 'a')
    assert len(read_ahead.take(str(tmp_path / 'a') + '/')) == 2
    assert read_ahead.take(tmp_path / 'a') is None  # handed over once
    # a failed read is no state: the load reads the files itself
    (tmp_path / 'b' / 'optimizer_1.bin').write_bytes(b'not an archive')
    read_ahead.begin(tmp_path / 'b')
    assert read_ahead.take(tmp_path / 'b') is None


class OptimizerAtTrainBegin(Callback):
    """The optimizer's state as the resume loaded it (after
    AccelerateLoadInitState, which moves itself first)."""

    # observes, trains nothing: not recorded in the checkpoint
    unrecorded_params = True

    def on_train_begin(self, net, **kwargs):
        self.state_ = copy.deepcopy(net.optimizer_.state_dict())


def reads_of(monkeypatch):
    """The folders whose optimizers' files are read ahead, as they are."""
    reads = []
    original = accelerate_io.read_optimizer_states
    monkeypatch.setattr(accelerate_io, 'read_optimizer_states',
                        lambda folder, *args: reads.append(str(folder))
                        or original(folder, *args))
    return reads


def join_read_ahead_threads(timeout=60):
    for thread in threading.enumerate():
        if thread.name == 'checkpoint-read-ahead':
            thread.join(timeout)
            assert not thread.is_alive(), 'a read ahead did not end'


def saved_net(tmp_path, epochs=2):
    net = make_net(make_accelerator(), max_epochs=epochs, callbacks=[
        AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), keep_last=3)])
    net.fit(*make_data(n=96))
    return net


def resumed_net(tmp_path, epochs=2):
    probe = OptimizerAtTrainBegin()
    checkpoint = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), keep_last=3)
    net = make_net(make_accelerator(), max_epochs=epochs, callbacks=[
        checkpoint, AccelerateLoadInitState(checkpoint), ('probe', probe)])
    return net, probe


def test_a_resume_loads_the_optimizer_read_while_its_checkpoint_was_checked(
        tmp_path, monkeypatch):
    trained = saved_net(tmp_path)
    reads = reads_of(monkeypatch)
    net, probe = resumed_net(tmp_path)
    net.fit(*make_data(n=96))
    assert reads == [str(tmp_path / 'ck' / 'epoch-0002')]
    assert_same(probe.state_, trained.optimizer_.state_dict())
    assert probe.state_['state']


def test_the_read_of_a_checkpoint_the_check_refuses_is_dropped(tmp_path, monkeypatch):
    saved_net(tmp_path)
    optimizer_file = tmp_path / 'ck' / 'epoch-0002' / 'optimizer.bin'
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2] ^= 0xff  # same size: only the checksum tells
    optimizer_file.write_bytes(bytes(data))
    reads = reads_of(monkeypatch)
    net, probe = resumed_net(tmp_path)
    with pytest.warns(UserWarning, match='skipping checkpoint .*epoch-0002.*checksum'):
        net.fit(*make_data(n=96))
    join_read_ahead_threads()
    assert sorted(reads) == [str(tmp_path / 'ck' / f'epoch-000{epoch}') for epoch in (1, 2)]
    saved = torch.load(tmp_path / 'ck' / 'epoch-0001' / 'optimizer.bin', weights_only=True)
    assert saved['state']
    assert_same(probe.state_['state'], saved['state'])


def test_a_failed_read_ahead_leaves_the_load_to_load_state(tmp_path, monkeypatch):
    trained = saved_net(tmp_path)

    def failing(folder, *args):
        raise OSError(f"cannot read {folder}")

    replace_everywhere(monkeypatch, accelerate_io.read_optimizer_states, failing)
    net, probe = resumed_net(tmp_path)
    net.fit(*make_data(n=96))
    assert_same(probe.state_, trained.optimizer_.state_dict())


def test_a_net_sharing_its_accelerator_reads_its_own_optimizers_ahead(tmp_path, monkeypatch):
    """The optimizer files are numbered among the net's own optimizers, of
    the accelerator's registry (which holds the other nets' too)."""
    accelerator = make_accelerator()
    other = make_net(accelerator, max_epochs=1)
    other.fit(*make_data(n=96))
    checkpoint = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    trained = make_net(accelerator, max_epochs=2, callbacks=[checkpoint])
    trained.fit(*make_data(n=96))
    assert len(accelerate_io.optimizers(accelerator)) == 2
    counts = []
    original = accelerate_io.read_optimizer_states
    monkeypatch.setattr(accelerate_io, 'read_optimizer_states',
                        lambda folder, count, *args: counts.append(count)
                        or original(folder, count, *args))
    checkpoint = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    probe = OptimizerAtTrainBegin()
    resumed = make_net(accelerator, max_epochs=2, callbacks=[
        checkpoint, AccelerateLoadInitState(checkpoint), ('probe', probe)])
    resumed.fit(*make_data(n=96))
    assert counts == [1]
    assert_same(probe.state_, trained.optimizer_.state_dict())


def test_a_rank_that_checks_the_chosen_checkpoint_itself_reads_ahead_meanwhile(
        tmp_path, monkeypatch):
    """A rank that did not check it to choose it (not a committer: rank 1
    of a job, which rank 0's choice reaches by name) checks it as it reads
    it, and reads its optimizers' files meanwhile."""
    trained = saved_net(tmp_path)
    net = make_net(make_accelerator(), max_epochs=2).initialize()
    loaded_with = []
    original = accelerate_io.load_state

    def recorded(accelerator, folder, parts, states):
        def take():
            loaded_with.append(states())
            return loaded_with[-1]
        return original(accelerator, folder, parts, take)

    replace_everywhere(monkeypatch, original, recorded)
    reads = reads_of(monkeypatch)
    folder = str(tmp_path / 'ck' / 'epoch-0002')
    read_checkpoint(net, Chosen(folder), ResumeChecks(), *make_data(n=96))
    assert reads == [folder]
    assert len(loaded_with) == 1 and len(loaded_with[0]) == 1
    assert_same(net.optimizer_.state_dict(), trained.optimizer_.state_dict())


def test_a_rank_takes_what_it_read_while_waiting_for_the_choice_only_for_that_folder(
        tmp_path, monkeypatch):
    """A rank that waits for rank 0's choice reads the optimizers' files of
    the folder rank 0 checks first; where rank 0 chose another (it found
    that one damaged), the rank reads and loads the chosen one's."""
    saved_net(tmp_path)
    reads = reads_of(monkeypatch)
    chosen, expected = (str(tmp_path / 'ck' / f'epoch-000{epoch}') for epoch in (1, 2))
    for guess in (expected, chosen):
        net = make_net(make_accelerator(), max_epochs=2).initialize()
        reads.clear()
        read_ahead = OptimizerReadAhead(net.accelerator)
        read_ahead.begin(guess)
        read_checkpoint(net, Chosen(chosen, read_ahead=read_ahead), ResumeChecks(),
                        *make_data(n=96))
        # a dropped read ahead goes on on its thread, racing the load's own read
        join_read_ahead_threads()
        assert sorted(reads) == sorted({guess, chosen})
        saved = torch.load(tmp_path / 'ck' / 'epoch-0001' / 'optimizer.bin', weights_only=True)
        assert saved['state']
        assert_same(net.optimizer_.state_dict()['state'], saved['state'])

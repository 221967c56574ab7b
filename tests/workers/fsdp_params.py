"""Train a FixedNet under FSDP2 and save its parameters and a sharded
checkpoint, for tests/engine/test_fsdp_params.py to load into plain nets.

usage: fsdp_params.py FOLDER
  In every process: fit with a ``ParamsCheckpoint`` (torch files, every
  epoch) and a ``TrainEndParamsCheckpoint`` (safetensors) in
  ``FOLDER/params`` and an ``AccelerateCheckpoint`` in ``FOLDER/ck``
  (SHARDED_STATE_DICT: ``epoch-0002/pytorch_model_fsdp_0/``), then
  ``save_params`` into ``FOLDER/direct.pt`` and ``load_params`` of it,
  refused. Then the errors of what needs the plain module. Results in
  ``params-rank<r>.json``: the trained net's predictions on
  ``make_data(n=160)``, what ``unwrapped`` gives, the errors.
"""

import os
import sys

import torch
from torch.distributed.tensor import DTensor

from common import make_data, make_net, rank, write_result
from fsdp_backend import fsdp_accelerator
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    LoadInitParams,
    ParamsCheckpoint,
    TrainEndParamsCheckpoint,
    unwrapped,
)


def refusal(net):
    """The message of the ``ValueError`` that ``fit`` raises, or None."""
    X, y = make_data(n=64)
    try:
        net.fit(X, y)
    except ValueError as exc:
        return str(exc)
    return None


def refusals(accelerator, folder):
    def net_with(callback):
        return make_net(accelerator, max_epochs=1, callbacks=[callback])

    params = os.path.join(folder, 'refused')
    return {
        'f_optimizer': refusal(net_with(ParamsCheckpoint(dirname=params, monitor=None))),
        'f_pickle': refusal(net_with(ParamsCheckpoint(
            dirname=params, monitor=None, f_optimizer=None, f_pickle='net.pkl'))),
        'load_best': refusal(net_with(ParamsCheckpoint(
            dirname=params, monitor='train_loss_best', f_optimizer=None, load_best=True))),
        'load_init': refusal(net_with(LoadInitParams(ParamsCheckpoint(dirname=params)))),
    }


def main(folder):
    accelerator = fsdp_accelerator(state_dict_type='SHARDED_STATE_DICT')
    X, y = make_data(n=160)
    params = os.path.join(folder, 'params')
    torch.manual_seed(0)
    net = make_net(accelerator, max_epochs=2, callbacks=[
        ParamsCheckpoint(dirname=params, monitor=None, f_optimizer=None),
        TrainEndParamsCheckpoint(dirname=params, use_safetensors=True, f_optimizer=None),
        AccelerateCheckpoint(dirname=os.path.join(folder, 'ck')),
    ])
    net.fit(X, y)
    with unwrapped(net):
        inside = {'type': type(net.module_).__name__, 'dtensors': all(
            isinstance(value, DTensor) for value in net.module_.state_dict().values())}
    # the mixin gathers the full parameters for the main process to write
    net.save_params(f_params=os.path.join(folder, 'direct.pt'))
    try:
        net.load_params(f_params=os.path.join(folder, 'direct.pt'))
        load_refused = None
    except ValueError as exc:
        load_refused = str(exc)
    write_result('params', {
        'num_processes': accelerator.num_processes,
        'rank': rank(),
        # a collective: every rank predicts on all of X
        'proba': net.predict_proba(X).tolist(),
        'unwrapped': inside,
        'refused': dict(refusals(accelerator, folder), load_params=load_refused),
    })
    accelerator.end_training()


if __name__ == '__main__':
    main(sys.argv[1])

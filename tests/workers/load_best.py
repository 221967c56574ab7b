"""Train with ``AccelerateCheckpoint(load_best=True)`` and record the model
each rank ends with, for tests/callbacks/test_load_best.py.

usage: load_best.py DIRNAME TAG
  Environment BACKEND: ``ddp`` (default) or ``fsdp2`` (forced on CPU,
  sharded state dict); STATE_DICT: FSDP2's ``state_dict_type``.

Epoch 2 of 4 is the only best one (:func:`best_at_epoch_2`), so the model
loaded at the end is not the last epoch's. Every rank writes
``<TAG>-rank<r>.pt``: the full parameters it ends with (under FSDP2
gathered), the last epoch's (taken before the load) and the best
checkpoint's path.
"""

import os
import sys

import torch
from skorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from common import NotTrainingState, make_accelerator, make_data, make_net, rank, settle_gloo
from fsdp_backend import fsdp_accelerator
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import accelerate_io


def best_at_epoch_2(net):
    return len(net.history) == 2


def full_params(net):
    """The module's full parameters, the same on every rank (FSDP2: gathered
    on every rank, a collective)."""
    if accelerate_io.is_fsdp2(net.accelerator):
        # without cpu_offload every rank gets the full tensors
        state = get_model_state_dict(net.module_,
                                     options=StateDictOptions(full_state_dict=True))
        return {key: value.detach().cpu().clone() for key, value in state.items()}
    module = net.accelerator.unwrap_model(net.module_)
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


class LastEpoch(NotTrainingState, Callback):
    """The model at the end of training, before the checkpoint's load_best
    (which runs after every other callback's on_train_end)."""

    def initialize(self):
        self.params_ = None
        return self

    def on_train_end(self, net, **kwargs):
        self.params_ = full_params(net)


def main():
    dirname, tag = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    if os.environ.get('BACKEND') == 'fsdp2':
        accelerator = fsdp_accelerator(
            state_dict_type=os.environ.get('STATE_DICT', 'SHARDED_STATE_DICT'))
    else:
        accelerator = make_accelerator()
    cp = AccelerateCheckpoint(dirname=dirname, monitor=best_at_epoch_2, keep_best=1,
                              load_best=True, sink=print)
    last = LastEpoch()
    net = make_net(accelerator, max_epochs=4, verbose=1, criterion=torch.nn.NLLLoss,
                   callbacks=[cp, AccelerateLoadInitState(cp), last])
    net.fit(*make_data(n=160))
    torch.save({'params': full_params(net), 'last': last.params_,
                'best': cp.find('best'), 'num_processes': accelerator.num_processes},
               os.path.join(os.environ.get('RESULT_DIR', '.'), f'{tag}-rank{rank()}.pt'))


if __name__ == '__main__':
    main()
    settle_gloo()

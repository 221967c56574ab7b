"""Train a FixedNet under FSDP2 and under DDP, for tests/callbacks/test_fsdp.py.

usage: fsdp_train.py
  In every process of the launch, the same net and data: ``fit``,
  ``predict_proba``, a warm ``partial_fit``, ``predict_proba``, a second
  ``fit``, ``predict_proba``; first with the FSDP2 back-end (forced on CPU by
  fsdp_backend), then with DDP. Results in ``train-rank<r>.json``: each
  back-end's losses and predictions, whether the FSDP2 module was sharded,
  and the errors of the nets FSDP2 refuses. Then the trainings of
  fsdp_resume.py that the environment RUNS lists.
"""

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import make_accelerator, make_data, make_net, settle_gloo, write_result
from fsdp_backend import fsdp_accelerator
from fsdp_resume import run_all


def losses(net):
    return [[row['train_loss'], row['valid_loss']] for row in net.history]


def train(accelerator):
    X, y = make_data()
    torch.manual_seed(0)
    net = make_net(accelerator, max_epochs=2, criterion=torch.nn.NLLLoss,
                   module__dropout=0.0)
    out = {'num_processes': accelerator.num_processes}
    net.fit(X, y)
    out['fit'] = {'losses': losses(net), 'proba': net.predict_proba(X[:40]).tolist()}
    # the root module keeps its parameters gathered after a forward
    if isinstance(net.module_, FSDPModule):
        net.module_.reshard()
    out['sharded'] = all(isinstance(param, DTensor) for param in net.module_.parameters())
    net.partial_fit(X, y)
    out['partial_fit'] = {'losses': losses(net), 'proba': net.predict_proba(X[:40]).tolist()}
    torch.manual_seed(0)
    net.fit(X, y)
    out['second_fit'] = {'losses': losses(net), 'proba': net.predict_proba(X[:40]).tolist()}
    return out


def refusal(net):
    try:
        net.initialize()
    except ValueError as exc:
        return str(exc)
    return None


def main():
    out = {'fsdp2': train(fsdp_accelerator())}
    accelerator = fsdp_accelerator()
    out['refused'] = {
        'trained_criterion': refusal(make_net(accelerator, criterion=torch.nn.Linear,
                                              criterion__in_features=2,
                                              criterion__out_features=2)),
    }
    out['ddp'] = train(make_accelerator())
    write_result('train', out)
    # the trainings of fsdp_resume in the same launch
    run_all()


if __name__ == '__main__':
    main()
    # FSDP2's own gathers (its forward) leave tensors to gloo's threads
    settle_gloo()

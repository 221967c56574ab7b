"""Foundation checks: sync primitives, ``unwrapped`` and the fixed mixin.

One launch runs every check (launches cost seconds); each rank writes what it
saw to ``foundation-rank<r>.json`` and the test compares across ranks.
"""

import os
import shutil
import tempfile

import torch
from torch.nn.parallel import DistributedDataParallel

from common import (
    StockNet,
    make_accelerator,
    make_data,
    make_net,
    params_digest,
    plain_criterion,
    rank,
    write_result,
)
from skorch_accel_callbacks import RankError, unwrapped
from skorch_accel_callbacks._core import sync


def registry_sizes(accelerator):
    return [len(accelerator._models), len(accelerator._optimizers),
            len(accelerator._schedulers), len(accelerator._dataloaders)]


def held_by_gloo(exchange):
    """Run ``exchange()``; return whether it passed tensors to a collective,
    and how many of them a collective still held when it returned."""
    passed = []
    saved = torch.distributed.all_gather, torch.distributed.broadcast

    def all_gather(tensor_list, tensor, *args, **kwargs):
        passed.extend([*tensor_list, tensor])
        return saved[0](tensor_list, tensor, *args, **kwargs)

    def broadcast(tensor, *args, **kwargs):
        passed.append(tensor)
        return saved[1](tensor, *args, **kwargs)

    torch.distributed.all_gather, torch.distributed.broadcast = all_gather, broadcast
    try:
        exchange()
    finally:
        torch.distributed.all_gather, torch.distributed.broadcast = saved
    return [bool(passed), sum(tensor._use_count() > 1 for tensor in passed)]


def check_sync(net, out):
    out['num_processes'] = sync.num_processes(net)
    out['held_by_gloo'] = [held_by_gloo(lambda: sync.broadcast(net, 'x')),
                           held_by_gloo(lambda: sync.gather(net, rank()))]
    out['broadcast'] = sync.broadcast(net, f"from rank {rank()}")
    out['gather'] = sync.gather(net, rank() * 10)
    try:
        sync.run_on_main(net, lambda: 1 / 0, 'division')
        out['run_on_main_error'] = None
    except ZeroDivisionError as exc:
        out['run_on_main_error'] = f"ZeroDivisionError: {exc}"
    except RankError as exc:
        out['run_on_main_error'] = f"RankError: {exc}"
    out['run_on_main_value'] = sync.run_on_main(net, lambda: rank() + 41, 'answer')
    last = sync.num_processes(net) - 1
    try:
        with sync.agree(net, 'the last rank step'):
            if rank() == last:
                raise OSError("disk on fire")
        out['agree_error'] = None
    except OSError as exc:
        out['agree_error'] = f"OSError: {exc}"
    except RankError as exc:
        out['agree_error'] = f"RankError: {exc}"
    # a plain net without accelerate is single-process
    plain = object()
    out['plain'] = [sync.num_processes(plain), sync.is_main_process(plain),
                    sync.broadcast(plain, rank()), sync.gather(plain, 'x')]
    sync.barrier(plain)


def check_unwrapped(accelerator, X, y, tmp, out):
    net = make_net(accelerator, unwrap_after_train=False, max_epochs=1)
    net.fit(X, y)
    out['wrapped_type'] = type(net.module_).__name__
    out['is_ddp'] = isinstance(net.module_, DistributedDataParallel)
    before_sizes = registry_sizes(accelerator)
    module, optimizer = net.module_, net.optimizer_

    for _ in range(3):
        with unwrapped(net):
            assert type(net.module_).__name__ == 'MLP', type(net.module_)
            assert not net._wrapped_with_accelerator
            keys = list(net.module_.state_dict())
            # nested block: a no-op
            with unwrapped(net):
                assert type(net.module_).__name__ == 'MLP'
            assert not net._wrapped_with_accelerator
            net.save_params(f_params=os.path.join(tmp, 'unwrapped.pt'))
    out['unwrapped_keys'] = keys
    try:
        with unwrapped(net):
            raise KeyError('inside')
    except KeyError:
        pass
    out['same_objects'] = net.module_ is module and net.optimizer_ is optimizer
    out['rewrapped_flag'] = net._wrapped_with_accelerator
    out['sizes_before_after'] = [before_sizes, registry_sizes(accelerator)]

    # ranks load different files inside the block; a common file after: same weights
    torch.manual_seed(100 + rank())
    with unwrapped(net):
        own = {k: torch.randn_like(v) for k, v in net.module_.state_dict().items()}
    if rank() == 0:
        common = {k: torch.randn_like(v) for k, v in own.items()}
        torch.save(common, os.path.join(tmp, 'common.pt'))
    sync.barrier(net)
    with unwrapped(net):
        net.module_.load_state_dict(own)
    out['digest_own'] = params_digest(net.module_)
    with unwrapped(net):
        net.module_.load_state_dict(torch.load(os.path.join(tmp, 'common.pt')))
    out['digest_common'] = params_digest(net.module_)
    # ranks see different batches; the step only stays in sync if DDP works
    net.partial_fit(X[rank()::2], y[rank()::2])
    out['digest_after_step'] = params_digest(net.module_)
    out['digest_changed'] = out['digest_after_step'] != out['digest_common']


def models_per_save(net, accelerator, path, X, y):
    """Fit ``net``, then save its params 3 times; the number of models the
    accelerator holds before and after each save."""
    net.fit(X, y)
    models = [len(accelerator._models)]
    for _ in range(3):
        net.save_params(f_params=path)
        models.append(len(accelerator._models))
    return models


def check_upstream_growth(accelerator, X, y, tmp, out):
    net = make_net(accelerator, net_cls=StockNet, criterion=plain_criterion,
                   unwrap_after_train=False, max_epochs=1)
    out['stock_models_per_save'] = models_per_save(
        net, accelerator, os.path.join(tmp, 'stock.pt'), X, y)


def check_fixed_mixin(accelerator, X, y, tmp, out):
    net = make_net(accelerator, unwrap_after_train=False, max_epochs=1)
    out['fixed_models_per_save'] = models_per_save(
        net, accelerator, os.path.join(tmp, 'fixed.pt'), X, y)
    loaders = []
    for _ in range(3):
        net.partial_fit(X, y)
        net.predict(X)
        loaders.append(len(accelerator._dataloaders))
    out['fixed_dataloaders'] = loaders

    # a second initialize, then fit: the new module has to be prepared
    net.initialize()
    net.fit(X[rank()::2], y[rank()::2])
    out['reinit_is_ddp'] = isinstance(net.module_, DistributedDataParallel)
    out['reinit_digest'] = params_digest(net.module_)
    out['reinit_models'] = len(accelerator._models)

    # warm start after unwrap_after_train=True trains the wrapped module
    warm = make_net(accelerator, warm_start=True, max_epochs=1)
    warm.fit(X, y)
    out['warm_unwrapped_after_train'] = type(warm.module_).__name__
    warm.fit(X[rank()::2], y[rank()::2])
    out['warm_digest'] = params_digest(warm.module_)

    # the save and load round trip through the fixed mixin on every rank
    net.save_params(f_params=os.path.join(tmp, 'round.pt'))
    fresh = make_net(accelerator, max_epochs=1)
    fresh.load_params(f_params=os.path.join(tmp, 'round.pt'))
    out['load_roundtrip'] = params_digest(fresh.module_) == params_digest(net.module_)


def check_stock_reinit(accelerator, X, y, out):
    net = make_net(accelerator, net_cls=StockNet, criterion=plain_criterion,
                   unwrap_after_train=False, max_epochs=1)
    net.fit(X, y)
    net.initialize()
    net.fit(X[rank()::2], y[rank()::2])
    out['stock_reinit_is_ddp'] = isinstance(net.module_, DistributedDataParallel)
    out['stock_reinit_digest'] = params_digest(net.module_)


def check_stock_parameterless_criterion(accelerator, X, y, out):
    net = make_net(accelerator, net_cls=StockNet, max_epochs=1)
    try:
        net.fit(X, y)
        out['stock_nll_error'] = None
    except Exception as exc:  # pylint: disable=broad-except
        out['stock_nll_error'] = str(exc)


def main():
    accelerator = make_accelerator()
    X, y = make_data()
    out = {}
    # one folder the ranks share, made and removed by the main process
    tmp = sync.broadcast(type('Net', (), {'accelerator': accelerator})(),
                         tempfile.mkdtemp() if accelerator.is_main_process else None)
    try:
        net = make_net(accelerator)
        check_sync(net, out)
        check_unwrapped(accelerator, X, y, tmp, out)
        check_fixed_mixin(accelerator, X, y, tmp, out)
        check_stock_reinit(accelerator, X, y, out)
        check_upstream_growth(accelerator, X, y, tmp, out)
        check_stock_parameterless_criterion(accelerator, X, y, out)
        # no rank reads the folder any more
        accelerator.wait_for_everyone()
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
    write_result('foundation', out)


if __name__ == '__main__':
    main()

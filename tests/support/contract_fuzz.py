"""The resume contract's fuzzer: Hypothesis strategies of configurations,
the runners (in this process, or launched in 2 processes), and the oracle.

A configuration (see tests/workers/contract_run.py, which runs one) draws
the net, its callbacks, the saves, the script of fit calls, the
interruption, a change between launches and the training data pipeline
(:func:`data_pipelines`: loader workers, persistent or not, the loader's own
generator, rows drawing random numbers as they are read). It is a
plain JSON-able dict, so that a failure prints it as it is and
``CONTRACT_CONFIG='<json>'`` reruns it (test_contract_fuzz.py::test_replay).

The oracle is the contract, not an implementation:

- no change between the launches: the relaunch finishes, and every rank
  ends bit-identical (torch.equal, ==) to that rank of the uninterrupted
  run: parameters, optimizer state, module buffers, the history (less the
  columns that differ by construction: ``dur``, wall-clock time, and
  ``event_acp``, since a SIGTERM's or Ctrl-C's save is an extra one), each
  callback's fitted attributes (EarlyStopping's counters, LRScheduler's
  scheduler state, the user callback's per-rank tallies; EpochScoring's
  scratch space of the epoch under way aside) and the optimizer steps;
- a change: refused with a CheckpointError whose message names it
  (``lr``, ``batch_size``, ``callbacks__<name>__<param>``, for reordered
  unnamed callbacks their names), or, where ``check_params`` names it (or
  the contract lets it through: a new batch size from an epoch's end, named
  callbacks in another order), accepted with the new value in force: the
  optimizer's groups and a scheduler's ``base_lrs`` for ``lr``, the
  callback's argument and its scheduler's for a callback setting;
- 2 processes -> 1 with ``on_world_size_change='reseed'`` (not exact):
  the relaunch finishes every epoch, each with one process's batches, and
  counts its optimizer steps on;
- every refusal's advice names what exists: each path in the message
  exists, and advice to resume an epoch's end has one in the folder;
- retention: after a relaunch that saved, the folder holds the
  ``keep_last`` newest, the newest of an epoch's end, the best, and the
  checkpoint it resumed from only while the fit call that resumed from it
  is the script's last;
- ``net.load_params(checkpoint=...)`` of a plain net after the relaunch,
  the newest checkpoint's model file damaged (1 process): at most one
  warning naming it, and the checkpoint before it loaded if there is one;
- the first launch ends as its interruption says (preempted by a SIGTERM,
  the crash's exception, a SIGKILL's exit -9, finished if it did not fire);
- never a hang (each launch under a deadline, collectives under
  ``COLLECTIVE_TIMEOUT``), never another exception.
"""

import json
import math
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st

from contract_run import load_damaged, run
from launcher import launch

# ------------------------------------------------------------------ strategies

BATCH_SIZES = (8, 12, 16, 24, 32)
CLASS_NAMES = {
    'early_stopping': 'EarlyStopping', 'lr_scheduler': 'LRScheduler',
    'grad_clip': 'GradientNormClipping', 'epoch_scoring': 'EpochScoring',
    'batch_scoring': 'BatchScoring', 'freezer': 'Freezer',
    'params_checkpoint': 'ParamsCheckpoint', 'tally': 'PerRankTally',
}
# the kinds drawn at most once, and the names a named one gets
OTHER_KINDS = ('tally', 'lr_scheduler', 'grad_clip', 'epoch_scoring', 'batch_scoring',
               'freezer', 'params_checkpoint')
NAMES = {'tally': 'tally', 'lr_scheduler': 'lr_scheduler', 'grad_clip': 'clip',
         'epoch_scoring': 'score', 'batch_scoring': 'batch_score', 'freezer': 'freezer',
         'params_checkpoint': 'params'}


@st.composite
def early_stopping(draw, valid):
    monitor = draw(st.sampled_from(('valid_loss', 'valid_acc', 'train_loss') if valid
                                   else ('train_loss',)))
    return {'monitor': monitor, 'patience': draw(st.integers(1, 4)),
            'threshold': draw(st.sampled_from((1e-4, 0.0, 0.01))),
            'lower_is_better': monitor != 'valid_acc'}


@st.composite
def lr_scheduler(draw, valid, plateau=True):
    policy = draw(st.sampled_from(('StepLR', 'LambdaLR', 'CosineAnnealingLR')
                                  + (('ReduceLROnPlateau',) if plateau else ())))
    if policy == 'ReduceLROnPlateau':
        return {'policy': policy, 'monitor': 'valid_loss' if valid else 'train_loss',
                'patience': draw(st.integers(0, 1)), 'factor': 0.5}
    params = {'policy': policy, 'step_every': draw(st.sampled_from(('epoch', 'batch')))}
    if policy == 'StepLR':
        params.update(step_size=draw(st.integers(1, 3)),
                      gamma=draw(st.sampled_from((0.5, 0.8))))
    elif policy == 'CosineAnnealingLR':
        params.update(T_max=draw(st.integers(2, 6)))
    else:
        params.update(lr_lambda='decay')
    return params


@st.composite
def other_callback(draw, kind, valid, backend, scheduled=False):
    if kind == 'tally':
        return {'scale': draw(st.sampled_from((1.0, 0.5)))}
    if kind == 'lr_scheduler':
        # an lr that check_params lets through must become the base lr
        # of a scheduler that has one
        return draw(lr_scheduler(valid, plateau=not scheduled))
    if kind == 'grad_clip':
        return {'gradient_clip_value': draw(st.sampled_from((1.0, 0.05, 10.0)))}
    if kind == 'epoch_scoring':
        return {'scoring': 'accuracy', 'lower_is_better': False, 'name': 'fuzz_acc',
                'on_train': draw(st.booleans()) if valid else True}
    if kind == 'batch_scoring':
        return {'scoring': 'accuracy', 'lower_is_better': False, 'name': 'fuzz_batch_acc',
                'on_train': draw(st.booleans()) if valid else True}
    if kind == 'freezer':
        return {'patterns': draw(st.sampled_from(('lin.bias', 'out.weight')))}
    params = {'monitor': 'valid_loss_best' if valid else None}
    if backend == 'fsdp2':
        # a plain optimizer file of a sharded module is refused (documented)
        params['f_optimizer'] = None
    return params


@st.composite
def callbacks(draw, valid, backend, scheduled=False, required=()):
    """Skorch's callbacks and the user's, named or not: the others first,
    the EarlyStoppings last (a callback after the one that stops misses
    that epoch's end: so a reorder of named ones changes nothing); with
    ``scheduled``, an LR scheduler with base lrs among them; every kind of
    ``required`` among them (a focused run's)."""
    kinds = draw(st.lists(st.sampled_from(OTHER_KINDS), unique=True, max_size=4))
    for kind in ('lr_scheduler',) * scheduled + tuple(required):
        if kind not in kinds:
            kinds.insert(draw(st.integers(0, len(kinds))), kind)
    specs = [{'kind': kind, 'name': NAMES[kind] if draw(st.booleans()) else None,
              'params': draw(other_callback(kind, valid, backend, scheduled))}
             for kind in kinds]
    n_stops = draw(st.integers(0, 2))
    named = draw(st.booleans())
    for i in range(n_stops):
        specs.append({'kind': 'early_stopping', 'name': f'stop{i + 1}' if named else None,
                      'params': draw(early_stopping(valid))})
    return specs


def skorch_name(specs, index):
    """The name skorch gives the callback at ``index`` (unnamed ones: the
    class name, numbered when the class repeats)."""
    spec = specs[index]
    if spec['name']:
        return spec['name']
    cls = CLASS_NAMES[spec['kind']]
    same = [i for i, other in enumerate(specs)
            if not other['name'] and CLASS_NAMES[other['kind']] == cls]
    return cls if len(same) == 1 else f'{cls}_{same.index(index) + 1}'


def changeable(spec):
    """Whether a setting of this callback is drawn to change: every
    callback's settings are recorded and checked, the user's own (the
    tally's ``scale``) as skorch's."""
    return spec['kind'] in ('early_stopping', 'grad_clip', 'tally') or (
        spec['kind'] == 'lr_scheduler' and spec['params']['policy'] != 'LambdaLR')


def changed_callback_params(draw, spec):
    """The callback's params with a setting changed (a policy swapped: all new)."""
    params, kind = dict(spec['params']), spec['kind']
    if kind == 'early_stopping':
        key = draw(st.sampled_from(('patience', 'threshold')))
        params[key] = params['patience'] + 1 if key == 'patience' else (
            0.05 if params['threshold'] != 0.05 else 0.0)
    elif kind == 'lr_scheduler' and params['policy'] == 'StepLR':
        swap = draw(st.sampled_from(('gamma', 'step_size', 'policy')))
        if swap == 'policy':
            params = {'policy': 'CosineAnnealingLR', 'step_every': params['step_every'],
                      'T_max': 3}
        elif swap == 'gamma':
            params['gamma'] = 0.3
        else:
            params['step_size'] += 1
    elif kind == 'lr_scheduler' and params['policy'] == 'CosineAnnealingLR':
        params['T_max'] += 1
    elif kind == 'lr_scheduler' and params['policy'] == 'ReduceLROnPlateau':
        params['factor'] = 0.3
    elif kind == 'grad_clip':
        params['gradient_clip_value'] = 0.01 if params['gradient_clip_value'] != 0.01 else 5.0
    elif kind == 'tally':
        params['scale'] = 0.5 if params['scale'] != 0.5 else 1.0
    return params


@st.composite
def changes(draw, config, kind):
    """The change between the launches of ``kind``: ``'scheduled_lr'`` is
    a new lr that check_params lets through, with an LR scheduler (issue
    28's item 4: its base lrs must take it)."""
    specs = config['callbacks']
    allow = draw(st.booleans())
    if kind == 'scheduled_lr':
        return {'kind': 'net', 'param': 'lr', 'name': 'lr', 'value': config['lr'] * 4,
                'allow': True}
    if kind == 'net':
        param = draw(st.sampled_from(('lr', 'batch_size', 'momentum')))
        value = {'lr': config['lr'] * 4,
                 'batch_size': draw(st.sampled_from(
                     [b for b in BATCH_SIZES if b != config['batch_size']])),
                 'momentum': 0.5 if config['momentum'] else 0.9}[param]
        name = param
        if param == 'momentum':
            name = 'optimizer__betas' if config['optimizer'] == 'adam' else 'optimizer__momentum'
        return {'kind': 'net', 'param': param, 'name': name, 'value': value, 'allow': allow}
    if kind == 'callback':
        candidates = [i for i, spec in enumerate(specs) if changeable(spec)]
        if candidates:
            index = draw(st.sampled_from(candidates))
            params = changed_callback_params(draw, specs[index])
            keys = sorted(k for k in set(params) | set(specs[index]['params'])
                          if params.get(k) != specs[index]['params'].get(k))
            name = skorch_name(specs, index)
            return {'kind': 'callback', 'index': index, 'params': params, 'allow': allow,
                    'names': [f'callbacks__{name}__{key}' for key in keys]}
    if kind == 'reorder':
        stops = [i for i, spec in enumerate(specs) if spec['kind'] == 'early_stopping']
        others = [i for i in range(len(specs)) if i not in stops]
        options = []
        if len(others) >= 2:
            options.append(list(reversed(others)) + stops)
        if len(stops) == 2 and not specs[stops[0]]['name']:
            options.append(others + list(reversed(stops)))
        if options:
            return {'kind': 'reorder', 'order': draw(st.sampled_from(options))}
    if kind == 'world_size':
        return {'kind': 'world_size'}
    if kind == 'accelerator' and config.get('accelerator'):
        param = draw(st.sampled_from(sorted(config['accelerator'])))
        if param == 'gradient_accumulation_steps':
            value = 3 - config['accelerator'][param]  # 1 <-> 2
        else:
            value = 'no' if config['accelerator'][param] == 'bf16' else 'bf16'
        return {'kind': 'accelerator', 'param': param, 'name': f'accelerator.{param}',
                'value': value, 'allow': allow}
    if kind == 'clone':
        return {'kind': 'clone'}
    return {'kind': 'none'}


def train_batches(config, nproc):
    """About how many training batches each rank runs per epoch."""
    rows = config['rows'] - (math.ceil(config['rows'] / 5) if config['valid'] else 0)
    per_rank = math.ceil(rows / nproc)
    if config['batchnorm']:
        return max(per_rank // config['batch_size'], 1)
    return math.ceil(per_rank / config['batch_size'])


@st.composite
def configs(draw, nproc=1, backend='none', interrupts=('none', 'sigterm', 'crash', 'sigint'),
            change_kinds=('none', 'net', 'scheduled_lr', 'callback', 'reorder', 'accelerator',
                          'clone'),
            scripts=('fit', 'fit+partial_fit', 'warm_start'), compile_modes=(False,),
            required_callbacks=()):
    """A configuration of one example (see the module docstring);
    ``compile_modes`` (False, True) draws torch.compile too (``make fuzz``:
    each compiled launch spends seconds compiling); ``required_callbacks``:
    kinds of :data:`OTHER_KINDS` that every example has."""
    valid = draw(st.booleans())
    change_kind = draw(st.sampled_from(change_kinds))
    config = {
        'nproc': nproc, 'backend': backend,
        'rows': draw(st.integers(64, 160)), 'hidden': draw(st.sampled_from((16, 8, 32))),
        'batchnorm': draw(st.booleans()), 'dropout': draw(st.sampled_from((0.0, 0.2))),
        'lr': draw(st.sampled_from((0.05, 0.02, 0.1))),
        'momentum': draw(st.sampled_from((0.9, 0.0))),
        'optimizer': draw(st.sampled_from(('sgd', 'adam'))),
        'batch_size': draw(st.sampled_from(BATCH_SIZES)),
        'max_epochs': draw(st.integers(2, 5)), 'valid': valid,
        'script': draw(st.sampled_from(scripts)),
        'callbacks': draw(callbacks(valid, backend, scheduled=change_kind == 'scheduled_lr',
                                    required=required_callbacks)),
        'saves': {'every_n_epochs': draw(st.integers(1, 2)),
                  'every_n_steps': draw(st.one_of(st.none(), st.integers(2, 7))),
                  # FSDP2 saves synchronously (the package refuses async_save there)
                  'async_save': draw(st.booleans()) if backend != 'fsdp2' else False,
                  'keep_last': draw(st.integers(1, 3))},
        'data': draw(data_pipelines()),
        'accelerator': draw(accelerator_settings(backend)),
    }
    # skorch's compile=True beside accelerate's bf16 fails in a later fit
    # with or without this package (TypeError: forward() takes 2 positional
    # arguments but 3 were given, skorch 1.4, accelerate 1.15): not drawn
    config['compile'] = (draw(st.sampled_from(compile_modes)) and backend != 'fsdp2'
                         and config['accelerator'].get('mixed_precision') != 'bf16')
    calls = 1 if config['script'] == 'fit' else 2
    total = calls * config['max_epochs'] * train_batches(config, nproc)
    kind = draw(st.sampled_from(interrupts))
    config['interrupt'] = {'kind': kind, 'batch': draw(st.integers(1, total)),
                           'who': draw(st.sampled_from(('all', 'rank0')))
                           if kind == 'sigterm' and nproc > 1 else 'all'}
    if nproc == 1:
        # after the relaunch, net.load_params(checkpoint=...) with the
        # newest checkpoint's model file damaged (issue 28's item 8)
        config['damage'] = draw(st.sampled_from(('none', 'grown', 'truncated')))
    config['change'] = draw(changes(config, change_kind))
    return config


@st.composite
def accelerator_settings(draw, backend):
    """The Accelerator's settings that change what is trained: gradient
    accumulation and mixed precision (bf16 runs on CPU); FSDP2's
    Accelerator is the forced back-end's, with neither."""
    if backend == 'fsdp2':
        return {}
    return {'gradient_accumulation_steps': draw(st.sampled_from((1, 2))),
            'mixed_precision': draw(st.sampled_from(('no', 'bf16')))}


@st.composite
def data_pipelines(draw):
    """The training data pipeline (``common.data_pipeline``): loader workers,
    persistent or not, the loader's own shuffling generator, and a data set
    that draws random numbers as it reads a row (torch's, numpy's or
    Python's generator)."""
    workers = draw(st.sampled_from((0, 2)))
    augment = draw(st.sampled_from((None, 'torch', 'numpy', 'python')))
    pipeline = {'num_workers': workers}
    # persistent workers that draw are refused at the first batch
    # (tests/state/test_data_pipeline.py), not resumed
    if workers and augment is None:
        pipeline['persistent_workers'] = draw(st.booleans())
    if augment is not None:
        pipeline['augment'] = augment
    if draw(st.booleans()):
        pipeline['generator'] = draw(st.integers(0, 2 ** 16))
    return pipeline


# ------------------------------------------------------------------ running

def reproduction(configs_):
    """How to rerun a failing example: its configuration(s) and a command."""
    text = json.dumps(configs_, sort_keys=True)
    return (f"configuration(s): {text}\nrerun: CONTRACT_CONFIG={shlex.quote(text)} "
            "PYTHONPATH=.:tests/support:tests/workers .venv/bin/python "
            "tests/callbacks/test_contract_fuzz.py")


CHECKPOINT_NAME = re.compile(r'epoch-\d{4}(-step-\d{8})?')


def folder_facts(folder):
    """What the oracle needs of a folder: its committed checkpoints (oldest
    commit first), for each its manifest's complete epochs and whether it
    was taken inside an epoch, and the checkpoint ``best.json`` names."""
    folder = Path(folder)
    found = []
    for path in folder.glob('epoch-*'):
        if CHECKPOINT_NAME.fullmatch(path.name) and (path / 'manifest.json').exists():
            manifest = json.loads((path / 'manifest.json').read_text())
            found.append((os.path.getmtime(path / 'manifest.json'), path.name, {
                'epochs': manifest.get('epoch', 0),
                'inside': bool((manifest.get('position') or {}).get('batches', 0))}))
    found.sort()
    committed = [name for _, name, _ in found]
    best = None
    if (folder / 'best.json').exists():
        best = json.loads((folder / 'best.json').read_text()).get('name')
    return {'committed': committed, 'newest_inside': bool(found) and found[-1][2]['inside'],
            'manifests': {name: facts for _, name, facts in found}, 'best': best}


def run_in_process(config, where):
    """The three launches of a 1-process example in this process."""
    where = Path(where)
    reference = run(config, str(where / 'A'), 'reference')
    first = run(config, str(where / 'B'), 'first')
    facts = folder_facts(where / 'B')
    relaunch = run(config, str(where / 'B'), 'relaunch')
    results = {'reference': [reference], 'first': {'outcomes': [first], 'returncodes': [0]},
               'folder': str(where / 'B'),
               'facts': facts, 'relaunch': [relaunch], 'where': str(where),
               'after': folder_facts(where / 'B')}
    committed = results['after']['committed']
    if config.get('damage', 'none') != 'none' and committed:
        results['load_params'] = load_damaged(config, str(where / 'B'),
                                              str(where / 'B' / committed[-1]))
    return results


def _launch_runs(runs, nproc, out, timeout):
    """One launch of contract_run.py doing ``runs``; (result, outcomes by tag)."""
    spec_file = Path(out) / f'runs-{runs[0]["tag"]}.json'
    spec_file.write_text(json.dumps(runs))
    result = launch('contract_run.py', nproc=nproc, timeout=timeout, env={
        'CONTRACT_RUNS': str(spec_file), 'RESULT_DIR': str(out),
        'COLLECTIVE_TIMEOUT': os.environ.get('FUZZ_COLLECTIVE_TIMEOUT', '30')})
    outcomes = {}
    for spec in runs:
        files = [Path(out) / f"{spec['tag']}-rank{r}.pt" for r in range(nproc)]
        outcomes[spec['tag']] = [torch.load(f, weights_only=False) if f.exists() else None
                                 for f in files]
    return result, outcomes


def _per_run_timeout(config):
    return 40 + 12 * config['max_epochs'] * (1 if config['script'] == 'fit' else 2)


def run_launched(batch, where):
    """The launches of a batch of 2-process examples: every reference run
    and every first run that ends without a SIGKILL in one launch, each
    first run with a SIGKILL in one of its own, every relaunch in one (on 1
    process those that change the number of processes)."""
    where = Path(where)
    out = where / 'results'
    out.mkdir(parents=True, exist_ok=True)
    results = [{'where': str(where), 'folder': str(where / f'{i}-B')} for i in range(len(batch))]
    launches = []
    shared = []
    for i, config in enumerate(batch):
        shared.append({'config': config, 'dirname': str(where / f'{i}-A'),
                       'phase': 'reference', 'tag': f'ref{i}'})
    killing = [i for i, c in enumerate(batch)
               if c['interrupt']['kind'] in ('sigkill', 'sigkill_in_save')]
    for i, config in enumerate(batch):
        if i not in killing:
            shared.append({'config': config, 'dirname': str(where / f'{i}-B'),
                           'phase': 'first', 'tag': f'first{i}'})
    timeout = sum(_per_run_timeout(spec['config']) for spec in shared)
    result, outcomes = _launch_runs(shared, 2, out, timeout)
    launches.append(result)
    for i in range(len(batch)):
        results[i]['reference'] = outcomes[f'ref{i}']
        if i not in killing:
            results[i]['first'] = {'outcomes': outcomes[f'first{i}'],
                                   'returncodes': result.returncodes}
    if not result.ok:
        return results, launches
    for i in killing:
        spec = {'config': batch[i], 'dirname': str(where / f'{i}-B'), 'phase': 'first',
                'tag': f'first{i}'}
        result, outcomes = _launch_runs([spec], 2, out, _per_run_timeout(batch[i]))
        fired = [(out / f'first{i}-fired-rank{r}.json').exists() for r in range(2)]
        killed = [(out / f'first{i}-killed-rank{r}.json').exists() for r in range(2)]
        results[i]['first'] = {'outcomes': outcomes[f'first{i}'], 'fired': fired,
                               'killed': killed, 'launcher_killed': result.killed,
                               'returncodes': result.returncodes, 'report': result.report()}
    for i in range(len(batch)):
        results[i]['facts'] = folder_facts(where / f'{i}-B')
    for nproc in (2, 1):
        relaunches = [{'config': c, 'dirname': str(where / f'{i}-B'), 'phase': 'relaunch',
                       'tag': f'again{i}'} for i, c in enumerate(batch)
                      if (c['change']['kind'] == 'world_size') == (nproc == 1)]
        if not relaunches:
            continue
        timeout = sum(_per_run_timeout(spec['config']) for spec in relaunches)
        result, outcomes = _launch_runs(relaunches, nproc, out, timeout)
        launches.append(result)
        for spec in relaunches:
            i = int(spec['tag'][len('again'):])
            results[i]['relaunch'] = outcomes[spec['tag']]
            results[i]['after'] = folder_facts(where / f'{i}-B')
    return results, launches


# ------------------------------------------------------------------ oracle

class ContractViolation(AssertionError):
    """A breach of the contract; a subclass per check (see :func:`fail`)."""


_KINDS = {}


def fail(message, kind=None):
    """Raise a :class:`ContractViolation` of the check that failed: its
    ``kind``, by default the calling check's name and line. Hypothesis
    tells failures apart by their exception's type and place, and all are
    raised here: by the type, each check's failures are shrunk and reported
    on their own, not only the simplest of them all."""
    if kind is None:
        caller = sys._getframe(1)
        kind = f'{caller.f_code.co_name}_line{caller.f_lineno}'
    if kind not in _KINDS:
        _KINDS[kind] = type(f'ContractViolation_{kind}', (ContractViolation,), {})
    raise _KINDS[kind](message)


def assert_same(a, b, where):
    """Bit-identical nested states; the first difference named."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            fail(f"{where} differs: {_short(a)} uninterrupted, {_short(b)} resumed")
    elif isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            fail(f"{where}: keys {sorted(map(str, a))} uninterrupted, "
                 f"{sorted(map(str, b))} resumed")
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            fail(f"{where}: {len(a)} entries uninterrupted, {len(b)} resumed")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif a != b and not (isinstance(a, float) and isinstance(b, float)
                         and math.isnan(a) and math.isnan(b)):
        fail(f"{where} differs: {a!r} uninterrupted, {b!r} resumed")


def _short(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.flatten()[:4].tolist()}"
    return repr(value)[:80]


def _no_error(outcomes, what):
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            fail(f"{what}: rank {rank} wrote no result (it died, or a rank before it "
                 "hung or failed)")
        if outcome['status'] == 'error':
            fail(f"{what}: rank {rank} raised {outcome['message']}\n{outcome['traceback']}")


def check_first(config, first):
    """The first launch ended as its interruption says."""
    kind = config['interrupt']['kind']
    if kind in ('sigkill', 'sigkill_in_save'):
        check_sigkill(kind, first)
        return
    _no_error(first['outcomes'], 'the first launch')
    for rank, outcome in enumerate(first['outcomes']):
        expected = {'none': 'finished', 'sigterm': 'preempted', 'crash': 'crashed',
                    'sigint': 'interrupted'}[kind] if outcome['fired'] else 'finished'
        if kind == 'sigint' and config['nproc'] > 1 and outcome['fired']:
            # with several processes a Ctrl-C saves and stops every rank, as
            # a save_on_signal signal (docs/mid_epoch.rst): a
            # KeyboardInterrupt on one rank would hang the others
            expected = 'preempted'
        if kind == 'sigterm' and config['interrupt']['who'] == 'rank0':
            # the rank the signal reached decides for all
            expected = 'preempted' if first['outcomes'][0]['fired'] else 'finished'
        if outcome['status'] != expected:
            fail(f"first launch, rank {rank}: {outcome['status']}, expected {expected} "
                 f"({kind} {'fired' if outcome['fired'] else 'did not fire'})")


def check_sigkill(kind, first):
    """A SIGKILL killed the rank that sent it, by itself (not the launch's
    end): every rank that armed a ``sigkill`` sent it at once; a
    ``sigkill_in_save`` is sent by the rank that commits the next save,
    if a save comes after it was armed. A run it never killed ends without
    an error."""
    fired, killed = first['fired'], first['killed']
    for rank, sent in enumerate(killed):
        if sent and (first['returncodes'][rank] != -9 or rank in first['launcher_killed']):
            fail(f"rank {rank} sent itself the {kind}, but exited "
                 f"{first['returncodes'][rank]} (ranks the launch had to kill: "
                 f"{first['launcher_killed']})\n{first['report']}")
    if kind == 'sigkill' and fired != killed:
        fail(f"the sigkill armed on ranks {fired} was sent by ranks {killed}\n{first['report']}")
    if kind == 'sigkill_in_save' and any(killed) and killed != [True, False]:
        fail(f"the kill inside a save was sent by ranks {killed}, not by the committer, rank 0")
    if not any(killed):
        _no_error(first['outcomes'], f'the first launch (its {kind} never killed a rank)')


def check_advice(message, folder, facts):
    """Every path a refusal names exists; advice to resume an epoch's end
    has one to resume."""
    for path in re.findall(r"(/[^\s'\",;()]+)", message):
        path = path.rstrip('.:')
        if path.startswith(str(folder)) and not os.path.exists(path):
            fail(f"the refusal names {path}, which does not exist: {message}")
    if 'resume=' in message and "epoch's end" in message:
        ends = [name for name in facts['committed'] if re.fullmatch(r'epoch-\d{4}', name)]
        if not ends:
            fail(f"the refusal advises resuming a checkpoint of an epoch's end, but the "
                 f"folder has none ({facts['committed']}): {message}")


# EpochScoring's scratch space of the epoch under way, emptied when an epoch
# begins: a relaunch of a finished run trains no epoch, and has it empty
SCRATCH_ATTRS = ('y_trues_', 'y_preds_')


def compared(state, config, first):
    """What of a rank's final state the contract holds exact, given how the
    first launch ended: the history's ``event_acp`` aside where a signal's
    save was an extra checkpoint, EpochScoring's scratch space aside where
    the relaunch trained nothing."""
    state = dict(state)
    signalled = config['interrupt']['kind'] in ('sigterm', 'sigint') and any(
        outcome['fired'] for outcome in first['outcomes'] if outcome)
    if signalled:
        state['history'] = [{k: v for k, v in row.items() if k != 'event_acp'}
                            for row in state['history']]
    interrupted = any(first.get('killed', ())) or any(
        outcome['status'] != 'finished' for outcome in first['outcomes'] if outcome)
    if not interrupted:
        state['callbacks'] = {name: {k: v for k, v in attrs.items() if k not in SCRATCH_ATTRS}
                              for name, attrs in state['callbacks'].items()}
    return state


def check_exact(reference, relaunch, config, first):
    for rank, (ref, got) in enumerate(zip(reference, relaunch, strict=True)):
        if ref['status'] != 'finished':
            fail(f"the uninterrupted run, rank {rank}: {ref['status']} {ref.get('message')}")
        if got['status'] != 'finished':
            fail(f"the relaunch, rank {rank}, without a change: {got['status']}: "
                 f"{got.get('message')}")
        a, b = compared(ref['state'], config, first), compared(got['state'], config, first)
        for part in ('params', 'optimizer', 'buffers', 'history', 'callbacks', 'global_step',
                     'random'):
            if config['backend'] == 'fsdp2' and rank > 0 and part in ('params', 'optimizer'):
                continue  # gathered on rank 0 only
            try:
                assert_same(a[part], b[part], f"rank {rank}: {part}")
                differs = None
            except ContractViolation as exc:
                differs = str(exc)
            if differs is not None:
                # a kind of its own for each part (outside the except: no chained context)
                fail(differs, kind=f'differs_{part}')


def expected_epochs(config):
    return config['max_epochs'] * (1 if config['script'] == 'fit' else 2)


def check_finishes(config, relaunch, first_nproc):
    """A relaunch that is not exact by design trains the epochs left and
    counts on: epochs 1..N, N the script's unless an EarlyStopping stopped;
    the optimizer steps those of every epoch's batches."""
    stops = any(spec['kind'] == 'early_stopping' for spec in config['callbacks'])
    for rank, outcome in enumerate(relaunch):
        if outcome['status'] != 'finished':
            fail(f"relaunch, rank {rank}: {outcome['status']}: {outcome.get('message')}")
        state = outcome['state']
        epochs = [row['epoch'] for row in state['history']]
        if epochs != list(range(1, len(epochs) + 1)):
            fail(f"relaunch, rank {rank}: epochs {epochs}")
        if len(epochs) > expected_epochs(config) or (
                not stops and len(epochs) != expected_epochs(config)):
            fail(f"relaunch, rank {rank}: {len(epochs)} epochs, the script trains "
                 f"{expected_epochs(config)}")
        # an optimizer step every `accumulation` batches and at an epoch's
        # end; epochs of the first launch and of a relaunch that changed
        # the accumulation ran with either
        counts = [row['train_batch_count'] for row in state['history']]
        low, high = (sum(math.ceil(count / steps) for count in counts)
                     for steps in (max(accumulations(config)), min(accumulations(config))))
        if not low <= state['global_step'] <= high:
            fail(f"relaunch, rank {rank}: {state['global_step']} optimizer steps counted, "
                 f"the history's epochs have {sum(counts)} batches, accumulated over "
                 f"{sorted(accumulations(config))}: {low} to {high} steps")


def accumulations(config):
    """The gradient accumulations the example's launches ran with."""
    found = {config.get('accelerator', {}).get('gradient_accumulation_steps', 1)}
    change = config['change']
    if change['kind'] == 'accelerator' and change['param'] == 'gradient_accumulation_steps':
        found.add(change['value'])
    return found


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check_in_force(config, relaunch):
    """The value a change let through is the one training ran with."""
    change = config['change']
    for rank, outcome in enumerate(relaunch):
        settings = outcome['state']['settings']
        if change['kind'] == 'net' and change['param'] in ('lr', 'momentum'):
            key, new = change['param'], change['value']
            schedulers = [entry['scheduler'] for entry in settings['callbacks'].values()
                          if 'scheduler' in entry]
            if key == 'lr' and schedulers and 'base_lrs' in schedulers[0]:
                got = schedulers[0]['base_lrs']
                if not all(_close(v, new) for v in got):
                    fail(f"rank {rank}: check_params let lr={new} through, but the "
                         f"scheduler's base_lrs are {got}")
            elif key == 'lr' and schedulers:
                factor = schedulers[0].get('factor', 0.5)
                for group in settings['groups']:
                    if not any(_close(group['lr'], new * factor ** k) for k in range(40)):
                        fail(f"rank {rank}: lr={new} let through, the optimizer runs "
                             f"at {group['lr']}")
            else:
                for group in settings['groups']:
                    # Adam's momentum is its beta1
                    got = group['betas'][0] if 'betas' in group and key == 'momentum' \
                        else group[key]
                    if not _close(got, new):
                        fail(f"rank {rank}: {key}={new} let through, the optimizer runs "
                             f"at {got}")
        if change['kind'] == 'accelerator':
            got = settings['accelerator'][change['param']]
            if got != change['value']:
                fail(f"rank {rank}: {change['name']}={change['value']!r} let through, the "
                     f"accelerator runs with {got!r}")
        if change['kind'] == 'callback':
            entry = settings['callbacks'][change['index']]
            old = config['callbacks'][change['index']]['params']
            for key, new in change['params'].items():
                if key in ('policy', 'lr_lambda'):
                    continue
                if entry.get(key) != new:
                    fail(f"rank {rank}: callback setting {key}={new} let through, the "
                         f"callback has {entry.get(key)!r}")
                scheduler = entry.get('scheduler', {})
                if key in scheduler and scheduler[key] != new:
                    fail(f"rank {rank}: {key}={new} let through, but the scheduler "
                         f"runs with {key}={scheduler[key]!r}")
            for key in set(old) - set(change['params']):
                if key in entry.get('scheduler', {}):
                    fail(f"rank {rank}: the scheduler is now {change['params']['policy']}, "
                         f"but holds the old one's {key}={entry['scheduler'][key]!r}")


def in_last_call(config, facts):
    """Whether a checkpoint of ``facts`` (its manifest's) was taken in the
    script's last fit call: epochs past the first call's, or inside the
    epoch after them."""
    if config['script'] == 'fit':
        return True
    epochs, last = facts['epochs'], config['max_epochs']
    return epochs > last or (epochs == last and facts['inside'])


def check_retention(config, before, after):
    """After a relaunch that saved, the folder holds what retention keeps:
    the ``keep_last`` newest, the newest of an epoch's end, the best, and
    the one the relaunch resumed from only if the script's last call (the
    fit under way at the end) resumed from it."""
    names = after['committed']
    if not before['committed'] or not set(names) - set(before['committed']):
        return  # nothing resumed, or nothing saved since
    resumed = before['committed'][-1]
    ends = [name for name in names if re.fullmatch(r'epoch-\d{4}', name)]
    kept = set(names[-config['saves']['keep_last']:]) | set(ends[-1:]) | {after['best']}
    if in_last_call(config, before['manifests'][resumed]):
        kept.add(resumed)
    extra = [name for name in names if name not in kept]
    if extra:
        fail(f"keep_last={config['saves']['keep_last']}, but after the relaunch (resumed "
             f"from {resumed}) the folder keeps {extra} besides {sorted(kept - {None})}: "
             f"{names}")


def check_resumed_own(folder, facts, relaunch):
    """A relaunch on a folder with checkpoints resumed from one of them on
    every rank: a run trained from scratch again would end where the
    uninterrupted run ended (the same seeds), and pass for a resume."""
    for rank, outcome in enumerate(relaunch):
        loaded = outcome.get('loaded_from')
        if loaded is None or os.path.dirname(loaded) != folder or (
                os.path.basename(loaded) not in facts['committed']):
            fail(f"relaunch, rank {rank}: resumed from {loaded}, not from a checkpoint of "
                 f"its folder {folder} ({facts['committed']})")


def check_load_params(loaded, after):
    """``net.load_params(checkpoint=...)`` with the newest checkpoint
    damaged says so once, and loads the one before it if there is one."""
    if len(loaded['warnings']) > 1:
        fail(f"load_params warned {len(loaded['warnings'])} times about the damaged "
             f"{loaded['damaged']}: {loaded['warnings']}")
    if len(after['committed']) > 1 and ('error' in loaded or not loaded['warnings']):
        fail(f"load_params with {loaded['damaged']} damaged and {after['committed'][-2]} "
             f"before it: {loaded.get('error', 'no warning about the damaged one')}")


def _refusal_names(config, facts):
    """The names a refusal of this change must contain, or None where the
    contract lets the change through."""
    change = config['change']
    if change['kind'] == 'net':
        if change['param'] == 'batch_size':
            # a new batch size resumes fine from an epoch's end
            return [change['name']] if facts['newest_inside'] else None
        return None if change['allow'] else [change['name']]
    if change['kind'] == 'callback':
        return None if change['allow'] else change['names']
    if change['kind'] == 'accelerator':
        if change['allow'] and change['param'] == 'gradient_accumulation_steps' \
                and facts['newest_inside']:
            # what a resume inside an epoch skips depends on it: refused even
            # where check_params lets it through (a new batch size likewise)
            return ['accumulation_steps: 1 in the checkpoint, 2 now'
                    if change['value'] == 2 else 'accumulation_steps: 2 in the checkpoint, 1 now']
        return None if change['allow'] else [change['name']]
    return None


def _swapped_unnamed(config):
    """The names that, after the reorder, belong to a callback of other
    settings (skorch names unnamed callbacks by class and position)."""
    change = config['change']
    if change['kind'] != 'reorder':
        return []
    specs = config['callbacks']
    moved = [specs[i] for i in change['order']]
    now = {skorch_name(moved, j): spec for j, spec in enumerate(moved)}
    return [skorch_name(specs, i) for i, spec in enumerate(specs)
            if now[skorch_name(specs, i)]['params'] != spec['params']]


def check_example(config, results):
    """The contract for one example's launches (see the module docstring)."""
    for rank, ref in enumerate(results.get('reference') or []):
        if ref is None or ref['status'] != 'finished':
            fail(f"the uninterrupted run, rank {rank}: "
                 f"{ref and ref['status']} {ref and ref.get('message')}"
                 f"{(ref or {}).get('traceback', '')}")
        if ref['num_processes'] != config['nproc']:
            fail(f"the uninterrupted run ran {ref['num_processes']} processes")
    check_first(config, results['first'])
    relaunch = results.get('relaunch')
    if relaunch is None:
        fail("no relaunch ran (a launch before it failed)")
    _no_error(relaunch, 'the relaunch')
    facts, change = results['facts'], config['change']
    refused = [o for o in relaunch if o['status'] == 'refused']
    if refused and len(refused) != len(relaunch):
        fail(f"ranks disagree on the refusal: {[o['status'] for o in relaunch]}")
    has_checkpoint = bool(facts['committed'])
    if refused:
        message = refused[0]['message']
        check_advice(message, results['where'], facts)
        must_name = _refusal_names(config, facts)
        if change['kind'] == 'reorder' and has_checkpoint:
            moved = _swapped_unnamed(config) or list(refused[0]['callback_names'].values())
            if not any(name in message for name in moved):
                fail(f"reordered callbacks refused without naming {moved}: {message}")
            return
        if change['kind'] == 'none' or must_name is None or not has_checkpoint:
            fail(f"relaunch refused, where the contract resumes "
                 f"({change}): {refused[0]['error']}: {message}")
        missing = [name for name in must_name if name not in message]
        if missing:
            fail(f"the refusal does not name {missing}: {message}")
        return
    if not has_checkpoint:
        # nothing was saved: the relaunch trained from scratch
        check_finishes(config, relaunch, config['nproc'])
        return
    if change['kind'] == 'world_size':
        if relaunch[0]['num_processes'] != 1:
            fail(f"the relaunch ran {relaunch[0]['num_processes']} processes, not 1")
        check_finishes(config, relaunch, 2)
        state = relaunch[0]['state']
        resumed_epochs = len(state['loader_batches'])
        one_process = state['loader_batches'][-1] if state['loader_batches'] else None
        for row in state['history'][len(state['history']) - resumed_epochs + 1:]:
            if one_process is not None and row['train_batch_count'] != one_process:
                fail(f"epoch {row['epoch']} after the 2 -> 1 resume trained "
                     f"{row['train_batch_count']} batches, one process has {one_process}")
        return
    check_resumed_own(results['folder'], facts, relaunch)
    must_name = _refusal_names(config, facts)
    if must_name is not None:
        fail(f"the change {change} was not refused (names {must_name} expected in a "
             "CheckpointError); the relaunch trained on")
    swapped = _swapped_unnamed(config)
    if swapped:
        fail(f"unnamed callbacks reordered, {swapped} now name callbacks of other "
             "settings, and the relaunch was not refused")
    check_retention(config, facts, results['after'])
    if 'load_params' in results:
        check_load_params(results['load_params'], results['after'])
    if change['kind'] in ('none', 'reorder', 'clone'):
        check_exact(results['reference'], relaunch, config, results['first'])
        return
    check_finishes(config, relaunch, config['nproc'])
    check_in_force(config, relaunch)


def check_batch(batch, results, launches):
    """The contract for each example of a launched batch; a launch that
    timed out fails (a hang), naming the example it was in."""
    for i, (config, result) in enumerate(zip(batch, results, strict=True)):
        try:
            check_example(config, result)
        except ContractViolation as exc:
            hung = [launch for launch in launches if launch.timed_out]
            extra = ("\n(a launch timed out: a hang)\n" + hung[0].report()[-4000:]
                     if hung else '')
            raise type(exc)(f"example {i} of the batch: {exc}{extra}") from None
    for launch_ in launches:
        if launch_.timed_out:
            fail(f"a launch timed out (a hang):\n{launch_.report()[-4000:]}")


def temp_folder():
    return tempfile.TemporaryDirectory(prefix='contract-')

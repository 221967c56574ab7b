"""ParamsCheckpoint under SIGKILLs at every point of its save, in 2 processes.

ParamsCheckpoint keeps skorch's layout, one file per artefact. The files of
a save are written under temporary names, then moved into place together
with a journal of the moves (tests/faults/workers/params_killable.py kills
before and after the journal, before and after each move, inside a file and
at batch ends). Each launch must load what the killed one left without an
error, and what it loads (history, parameters, optimizer state) must be
exactly what one save wrote: never the params of one epoch beside the
optimizer or history of another. The launches go through the fork server of
tests/faults/conftest.py.
"""

import json
import random

import pytest

from params_killable import PARAMS_POINTS
from skorch_accel_callbacks.format import TEMP_MARK
from testutil import read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def test_params_checkpoint_kills_load_one_whole_save(zygote, tmp_path, record_property):
    rng = random.Random(0)
    points = list(PARAMS_POINTS)
    rng.shuffle(points)
    ckpt = tmp_path / 'ckpt'
    kills = 0
    for launch_no, point in enumerate(points + [None]):
        tag = f'launch{launch_no}'
        env = {}
        if point is not None:
            who = rng.randrange(2) if point.startswith('batch') else 0
            env['KILL'] = f'{rng.randint(1, 2)}:{point}:{who}'
        result = zygote.launch('params_killable.py', tmp_path, ckpt, tag, nproc=2, grace=1.0,
                               timeout=120, **env)
        assert not result.timed_out, result.report()
        loaded = [read_json(tmp_path / f'loaded-{tag}-rank{r}.json') for r in (0, 1)]
        assert loaded[0] == loaded[1], loaded  # every rank loaded the same
        if launch_no:
            saves = [json.loads(line) for line in
                     (tmp_path / 'saves.jsonl').read_text().splitlines()]
            assert loaded[0]['history_len'] > 0
            assert loaded[0] in saves, (tag, env, loaded[0])
        if point is None:
            result.check()
        else:
            landed = list(tmp_path.glob(f'killed-{tag}-*'))
            assert len(landed) == 1 and result.returncodes[who] == -9, result.report()
            kills += 1
    # the last launch finished what was left and saved cleanly
    assert not [p.name for p in ckpt.iterdir() if TEMP_MARK in p.name or 'commit' in p.name]
    record_property('summary', f'ParamsCheckpoint kills: {kills} kills, one at each of '
                               f'{len(PARAMS_POINTS)} points, {kills + 1} launches; every '
                               'launch loaded the files of one whole save')

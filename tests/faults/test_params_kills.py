"""ParamsCheckpoint under random SIGKILLs, in 2 processes.

ParamsCheckpoint keeps skorch's layout: one file per artefact, each written
under a temporary name and moved into place. So a kill leaves every file
whole and loadable, each from one completed save; between two files' moves
it can leave params of epoch N beside an optimizer/history of epoch N-1
(AccelerateCheckpoint, which commits a folder, has no such window). Each
launch must load what the killed one left without an error, and the loaded
parameters must be exactly ones that a save wrote.
"""

import json
import random

from faultsuite import read_json, run_job
from params_killable import PARAMS_POINTS

LAUNCHES = 6


def test_params_checkpoint_random_kills(tmp_path, record_property):
    # a seed whose draws cover a half-written file, renames and batch ends
    rng = random.Random(4)
    ckpt = tmp_path / 'ckpt'
    kills = 0
    for launch_no in range(LAUNCHES):
        tag = f'launch{launch_no}'
        env = {}
        last = launch_no == LAUNCHES - 1
        if not last:
            point = rng.choice(PARAMS_POINTS)
            who = rng.randrange(2) if point.startswith('batch') else 0
            env['KILL'] = f'{rng.randint(1, 2)}:{point}:{who}'
        result = run_job('params_killable.py', tmp_path, ckpt, tag, grace=1.0, timeout=120,
                         **env)
        assert not result.timed_out, result.report()
        loaded = [read_json(tmp_path / f'loaded-{tag}-rank{r}.json') for r in (0, 1)]
        assert loaded[0] == loaded[1], loaded  # every rank loaded the same
        if launch_no:
            saved = [json.loads(line) for line in
                     (tmp_path / 'digests.jsonl').read_text().splitlines()]
            assert loaded[0]['history_len'] > 0
            assert loaded[0]['digest'] in saved, (tag, env)
        if last:
            result.check()
        else:
            landed = list(tmp_path.glob(f'killed-{tag}-*'))
            assert len(landed) == 1 and result.returncodes[who] == -9, result.report()
            kills += 1
    record_property('summary', f'ParamsCheckpoint random kills: {LAUNCHES} launches, {kills} '
                               'kills; every launch loaded whole files of a completed save')

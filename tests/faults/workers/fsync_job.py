"""One process trains one epoch into a checkpoint folder, to be run under
``strace``'s fault injection of an fsync.

usage: fsync_job.py DIRNAME OUT [async]

With ``async``, the checkpoint is saved with ``async_save=True``.

The outcome (the error ``fit`` raised: type, errno, file name, message;
and where ``latest.json`` points) goes to the JSON file OUT.
"""

import json
import os
import sys

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint


def main(dirname, out, mode='sync'):
    outcome = {'type': None, 'errno': None, 'filename': None, 'text': None}
    net = make_net(make_accelerator(), max_epochs=1,
                   callbacks=[AccelerateCheckpoint(dirname=dirname,
                                                   async_save=mode == 'async')])
    try:
        net.fit(*make_data(n=64))
    except OSError as exc:
        outcome.update(type=type(exc).__name__, errno=exc.errno, filename=exc.filename,
                       text=str(exc))
    latest = os.path.join(dirname, 'latest.json')
    if os.path.exists(latest):
        with open(latest) as f:
            outcome['latest'] = json.load(f)
    with open(out, 'w') as f:
        json.dump(outcome, f)


if __name__ == '__main__':
    main(*sys.argv[1:])

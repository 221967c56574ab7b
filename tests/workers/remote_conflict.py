"""Two ranks save into an object store while another job commits the same
checkpoint: rank 0's upload is refused, and training fails on every rank.

usage: remote_conflict.py URL

Before this job's save of epoch 1, rank 0 writes ``epoch-0001/manifest.json``
into the store (another job's commit); the upload of epoch-0001 then fails on
rank 0 in the background; once it ended (``UploadsEnded`` waits for that
when epoch 2 begins: a save does not wait for a running upload), the wait
before the next save must raise on both ranks. Each rank writes
``conflict-rank<r>.json``: the error it raised.
"""

import sys

import fsspec
from skorch.callbacks import Callback

from common import UploadsEnded, make_accelerator, make_data, make_net, rank, write_result
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState


class AnotherJob(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, manifest):
        self.manifest = manifest

    def on_epoch_end(self, net, **kwargs):
        if rank() == 0 and len(net.history) == 1:
            fsspec.filesystem('s3').pipe_file(self.manifest, b'{"written by": "another job"}')


def main():
    url = sys.argv[1]
    accelerator = make_accelerator()
    cp = AccelerateCheckpoint(dirname=url)
    net = make_net(accelerator, max_epochs=3, callbacks=[
        cp, AccelerateLoadInitState(cp),
        AnotherJob(url[len('s3://'):] + '/epoch-0001/manifest.json'), UploadsEnded(epochs=(2,))])
    error = None
    try:
        net.fit(*make_data())
    except Exception as exc:  # pylint: disable=broad-except
        error = exc
    write_result('conflict', {
        'num_processes': accelerator.num_processes, 'epochs': len(net.history),
        'error': type(error).__name__, 'message': str(error)})


if __name__ == '__main__':
    main()

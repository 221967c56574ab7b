"""What the scripts of this folder share: data, model, net class, accelerator."""

import argparse
import hashlib
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin

from skorch_accel_callbacks import AccelerateFixesMixin

SEED = 0


class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    """skorch's accelerate support with this package's fixes."""


class MLP(torch.nn.Module):
    def __init__(self, n_in=64, hidden=128, n_out=10, dropout=0.3):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, hidden)
        self.dropout = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(hidden, n_out)

    def forward(self, X):
        # NeuralNetClassifier's default criterion, NLLLoss, takes probabilities
        return torch.softmax(self.out(self.dropout(torch.relu(self.hidden(X)))), dim=-1)


# the same arguments for every net of these scripts, accelerated or plain
NET_KWARGS = dict(
    module=MLP,
    lr=0.1,
    batch_size=64,
    optimizer=torch.optim.SGD,
    optimizer__momentum=0.9,
    iterator_train__shuffle=True,
)


def argument_parser(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        '--cpu', action='store_true',
        help="run on CPU: Accelerator(cpu=True), needed for several CPU processes "
             "started by torchrun")
    return parser


def make_accelerator(cpu):
    """A new Accelerator; every net gets its own, so that its registries hold
    only that net's module and optimizer."""
    return Accelerator(cpu=cpu)


def load_data():
    """scikit-learn's digits: 1500 images to train on, 297 to predict."""
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    return X[:1500], y[:1500], X[1500:]


def seed_everything():
    """Same seed on every process, deterministic kernels (for GPUs)."""
    # cuBLAS reads it when CUDA starts, later than this
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    torch.use_deterministic_algorithms(True)
    set_seed(SEED)


def params_sha256(module):
    """Fingerprint of a module's parameters: equal iff they are bit-identical."""
    digest = hashlib.sha256()
    for key, tensor in sorted(module.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()

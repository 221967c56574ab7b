"""Grid searches and cross-validation with checkpoints: a folder per fit.

``dirname='search/{fit}'`` gives each fit a folder named after its settings,
``max_epochs`` and training data: the candidates and folds of a
``GridSearchCV`` (which clones the net for each) never resume each other's
runs, and the same search relaunched after a crash resumes each fit that had
a checkpoint and ends as the uninterrupted search did.
"""

import pytest
import torch
from sklearn.model_selection import GridSearchCV, cross_validate
from skorch.callbacks import Callback

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

pytestmark = pytest.mark.slow

# the loaders' messages, by a function (a clone deep-copies a bound method's list)
MESSAGES = []
FITS_BEGUN = []


def record(message):
    MESSAGES.append(message)


class CrashInFit(Callback):
    """Raise inside the ``fit``-th fit of the process (counted from 1), after
    the first batch of its second epoch, as a crash would end a search."""

    # injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, fit=None):
        self.fit = fit

    def on_train_begin(self, net, **kwargs):
        FITS_BEGUN.append(1)

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(FITS_BEGUN) == self.fit and len(net.history) == 2:
            raise RuntimeError('crashed inside a fit of the search')


def search_net(dirname, crash=None):
    cp = AccelerateCheckpoint(dirname=str(dirname))
    return make_net(make_accelerator(), max_epochs=3,
                    callbacks=[AccelerateLoadInitState(cp, sink=record), cp,
                               CrashInFit(crash)])


def grid_search(dirname, crash=None):
    MESSAGES.clear()
    FITS_BEGUN.clear()
    torch.manual_seed(0)
    search = GridSearchCV(search_net(dirname, crash), {'lr': [0.05, 0.1]}, cv=2,
                          refit=False, error_score='raise')
    return search.fit(*make_data(n=128))


SCORES = ('split0_test_score', 'split1_test_score', 'mean_test_score', 'params')


def test_an_interrupted_grid_search_relaunched_resumes_and_ends_as_uninterrupted(tmp_path):
    uninterrupted = grid_search(tmp_path / 'A' / '{fit}')
    # one folder per candidate and fold
    assert len(list((tmp_path / 'A').iterdir())) == 4
    assert all(message.startswith('No checkpoint in') for message in MESSAGES)

    with pytest.raises(RuntimeError, match='crashed inside a fit of the search'):
        grid_search(tmp_path / 'B' / '{fit}', crash=3)
    assert len(FITS_BEGUN) == 3  # the crash fired, in the third fit

    relaunched = grid_search(tmp_path / 'B' / '{fit}')
    resumed = [message for message in MESSAGES if message.startswith('Resumed from')]
    fresh = [message for message in MESSAGES if message.startswith('No checkpoint in')]
    # the two finished fits and the crashed one (after its first epoch)
    assert len(resumed) == 3 and len(fresh) == 1, MESSAGES
    assert sum('after epoch 1' in message for message in resumed) == 1
    for key in SCORES:
        assert list(relaunched.cv_results_[key]) == list(uninterrupted.cv_results_[key]), key


def test_cross_validate_folds_get_folders_of_their_own(tmp_path):
    MESSAGES.clear()
    torch.manual_seed(0)
    X, y = make_data(n=128)
    first = cross_validate(search_net(tmp_path / '{fit}'), X, y, cv=3)
    folders = sorted(path.name for path in tmp_path.iterdir())
    assert len(folders) == 3
    # relaunched: each fold resumes its own finished run
    MESSAGES.clear()
    again = cross_validate(search_net(tmp_path / '{fit}'), X, y, cv=3)
    assert sorted(path.name for path in tmp_path.iterdir()) == folders
    assert sum(message.startswith('Resumed from') for message in MESSAGES) == 3
    assert list(again['test_score']) == list(first['test_score'])

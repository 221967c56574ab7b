"""FSDP2 through skorch: training, checkpoints and resumes, in 2 real
processes on CPU (the FSDP back-end forced by tests/workers/fsdp_backend.py,
``fully_shard`` with gloo)."""

import numpy as np
import pytest

# a hang in a collective fails the launch in seconds
SHORT_COLLECTIVES = {'COLLECTIVE_TIMEOUT': '30'}


@pytest.mark.slow
def test_fsdp2_trains_predicts_and_fits_again_as_ddp(run_workers):
    """The module and optimizer are prepared together and sharded; fit,
    predict on every rank, a warm partial_fit and a second fit give the
    losses and predictions of the same net under DDP; a criterion with
    parameters (a second model for FSDP2) is refused at initialize."""
    results = run_workers('fsdp_train.py', 'train', nproc=2, timeout=240,
                          env=SHORT_COLLECTIVES)
    for result in results:
        assert result['fsdp2']['num_processes'] == result['ddp']['num_processes'] == 2
        assert result['fsdp2']['sharded'] and not result['ddp']['sharded']
        for step in ('fit', 'partial_fit', 'second_fit'):
            fsdp2, ddp = result['fsdp2'][step], result['ddp'][step]
            np.testing.assert_allclose(fsdp2['losses'], ddp['losses'], rtol=1e-5)
            np.testing.assert_allclose(fsdp2['proba'], ddp['proba'], atol=1e-6)
        assert len(result['fsdp2']['partial_fit']['losses']) == 4
        assert len(result['fsdp2']['second_fit']['losses']) == 2
        assert result['refused']['trained_criterion'].startswith(
            'under FSDP2 the net must have exactly one module with trainable parameters '
            'and one optimizer')
        assert "criteria with trainable parameters ['criterion']" in \
            result['refused']['trained_criterion']
    # each rank's losses are those of its share of the data; the
    # predictions are gathered from every rank
    for step in ('fit', 'partial_fit', 'second_fit'):
        assert results[0]['fsdp2'][step]['proba'] == results[1]['fsdp2'][step]['proba']

"""What a checkpoint holds beside accelerate's save_state, and who may resume
it: the training state, the callbacks' states, the optimizers' settings,
random and loader states, the position in an epoch, the fingerprint of data
and settings, the settings and compatibility checks, the FSDP layout, and
how the loaders' workers start.

What the other subpackages use of it, and nothing else of it, is named
here (``__all__``); its modules are its own.
"""

from skorch_accel_callbacks.state._callback_states import (
    apply_callback_states,
    apply_epoch_caches,
    load_callback_states,
    load_epoch_caches,
    save_epoch_caches,
    unknown_batch_state,
)
from skorch_accel_callbacks.state._compat import (
    check_compatible,
    check_rank_files,
    check_same_data,
    check_world_size,
    checkpoint_record,
    model_files,
    model_layout,
    optimizer_layout,
    restore_frozen,
)
from skorch_accel_callbacks.state._epoch_position import (
    EpochStart,
    can_skip,
    check_can_skip,
    load_position,
    save_position,
)
from skorch_accel_callbacks.state._fingerprint import (
    data_fingerprint,
)
from skorch_accel_callbacks.state._fsdp_layout import (
    make_room_for_group_settings,
    shard_layout,
    warn_per_rank_buffers,
)
from skorch_accel_callbacks.state._loader_pass import (
    PassControl,
    ResumePlan,
    WorkerDraws,
    fetches_in_process,
    install,
    persistent_workers,
    seed_draw_undone,
    uninstall,
    worker_draws,
)
from skorch_accel_callbacks.state._optimizer_settings import (
    keep_new_base_lrs,
    keep_new_optimizer_settings,
    optimizer_hyperparameters,
    restore_optimizer_hyperparameters,
)
from skorch_accel_callbacks.state._rng_state import (
    apply_loader_state,
    capture_rng,
    derived_rank_state,
    derived_rng,
    reseed_origin,
    restore_rng,
)
from skorch_accel_callbacks.state._settings import (
    changed_callback_settings,
    check_epoch_settings,
    check_same_params,
    check_train_rows,
    epoch_end_advice,
    epoch_settings,
    fit_id,
    training_params,
)
from skorch_accel_callbacks.state._training_state import (
    encode_rank_states,
    epoch_completed,
    find_train_loader,
    load_buffers,
    load_history,
    load_rank_state,
    optimizer_steps,
    per_rank_items,
    save_rank_state,
    write_rank_states,
)
from skorch_accel_callbacks.state._worker_start import (
    warn_forked_workers_can_hang,
)

__all__ = [
    'apply_callback_states',
    'apply_epoch_caches',
    'apply_loader_state',
    'can_skip',
    'capture_rng',
    'changed_callback_settings',
    'check_can_skip',
    'check_compatible',
    'check_epoch_settings',
    'check_rank_files',
    'check_same_data',
    'check_same_params',
    'check_train_rows',
    'check_world_size',
    'checkpoint_record',
    'data_fingerprint',
    'derived_rank_state',
    'derived_rng',
    'encode_rank_states',
    'epoch_completed',
    'epoch_end_advice',
    'epoch_settings',
    'EpochStart',
    'fetches_in_process',
    'find_train_loader',
    'fit_id',
    'install',
    'keep_new_base_lrs',
    'keep_new_optimizer_settings',
    'load_buffers',
    'load_callback_states',
    'load_epoch_caches',
    'load_history',
    'load_position',
    'load_rank_state',
    'make_room_for_group_settings',
    'model_files',
    'model_layout',
    'optimizer_layout',
    'optimizer_hyperparameters',
    'optimizer_steps',
    'PassControl',
    'per_rank_items',
    'persistent_workers',
    'reseed_origin',
    'restore_frozen',
    'restore_optimizer_hyperparameters',
    'restore_rng',
    'ResumePlan',
    'save_epoch_caches',
    'save_position',
    'save_rank_state',
    'seed_draw_undone',
    'shard_layout',
    'training_params',
    'uninstall',
    'unknown_batch_state',
    'warn_forked_workers_can_hang',
    'warn_per_rank_buffers',
    'worker_draws',
    'WorkerDraws',
    'write_rank_states',
]

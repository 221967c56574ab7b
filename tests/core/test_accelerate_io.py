"""accelerate_io against accelerate itself: the names it gives files, the
internals it reads. (Its parts of ``save_state`` are checked against
``Accelerator.save_state`` in tests/engine/test_state_files.py.)"""

from skorch_accel_callbacks._core import accelerate_io


def test_fsdp_model_names_are_accelerates():
    """The names of an FSDP save's models come from accelerate's constant,
    in one place, as ``save_state`` numbers them."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    assert [accelerate_io.fsdp_model_file(i, sharded=True) for i in (0, 1)] == [
        f'{FSDP_MODEL_NAME}_0', f'{FSDP_MODEL_NAME}_1']
    assert [accelerate_io.fsdp_model_file(i, sharded=False) for i in (0, 1)] == [
        f'{FSDP_MODEL_NAME}.bin', f'{FSDP_MODEL_NAME}_1.bin']
    assert all(accelerate_io.is_fsdp_model_path(rel) for rel in (
        f'{FSDP_MODEL_NAME}_0/__0_0.distcp', f'{FSDP_MODEL_NAME}_1/.metadata',
        f'{FSDP_MODEL_NAME}.bin'))
    assert not any(accelerate_io.is_fsdp_model_path(rel) for rel in (
        'model.safetensors', 'optimizer_0/__0_0.distcp', f'{FSDP_MODEL_NAME}_x.bin'))

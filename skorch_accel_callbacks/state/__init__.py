"""What a checkpoint holds beside accelerate's save_state, and who may resume
it: the training state, random and loader states, the position in an epoch,
the fingerprint of data and settings, the settings and compatibility checks,
the FSDP layout.
"""

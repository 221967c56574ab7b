"""Reading a folder of checkpoints after training: the command line (python -m
skorch_accel_callbacks), inspection, export of a checkpoint's models as
skorch files, and the consolidation of FSDP shards.
"""

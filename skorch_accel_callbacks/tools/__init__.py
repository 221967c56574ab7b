"""Reading checkpoints after training, from a folder or a store alike: the
command line (python -m skorch_accel_callbacks), inspection, and export of a
checkpoint's models as skorch files.
"""

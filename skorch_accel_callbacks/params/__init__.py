"""skorch's Checkpoint, TrainEndCheckpoint and LoadInitState as drop-ins under
accelerate (ParamsCheckpoint, TrainEndParamsCheckpoint, LoadInitParams), on
the set of files one save writes.
"""

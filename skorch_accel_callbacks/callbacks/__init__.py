"""The checkpoint and resume callbacks (AccelerateCheckpoint,
AccelerateLoadInitState), the net mixin they need (AccelerateFixesMixin),
and their policies: when to save (triggers) and the signals that make a run
save and stop (preemption).
"""

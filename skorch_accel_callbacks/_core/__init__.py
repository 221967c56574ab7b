"""The core every layer above uses: the only code that talks across processes
(sync), every use of accelerate's internals (accelerate_io) and of skorch's
(skorch_io), the releases they were tested with (releases), unwrapping a
module (wrapping), what the callbacks share (base), what they say (messages)
and how they check their arguments (arguments).
"""

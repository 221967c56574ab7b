"""Where checkpoints live: the storage interface and its policy, written once
(which checkpoints, in what order, the pointers, retention, best); the
backends, a local folder and its lock, an object store through fsspec
(transfers, the lease, the upload of each node's files); and the function
that opens the one a ``dirname`` names.
"""

"""Where checkpoints live: the storage interface, a local folder and its lock,
an object store through fsspec (transfers, the lease, the upload of each
node's files).
"""

"""The on-disk format: the manifest and the name of every file and folder,
atomic files, and readers that load files without running code.
"""

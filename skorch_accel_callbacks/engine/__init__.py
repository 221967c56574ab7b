"""How a checkpoint is written and read back: the writer (in the fit's thread
or a background one), the stager (host copies that let a background save
return) and the restore.
"""

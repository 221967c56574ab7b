"""Where a callback runs among the net's callbacks.

skorch calls callbacks in the order of ``net.callbacks_``. A checkpoint has to
run after the callbacks whose end-of-epoch state it saves (EarlyStopping,
LRScheduler, scoring), and a resume has to run before the callbacks whose
state it restores, whatever order the user listed them in (Lightning runs its
ModelCheckpoint last for the same reason).
"""

from skorch.callbacks import PrintLog

__all__ = ['move_callback']


def move_callback(net, callback, where):
    """Move ``callback`` to the start (``'first'``) or the end (``'last'``,
    before PrintLog, so that its history column is printed) of
    ``net.callbacks_``.

    A new list is assigned, so a ``notify`` that is iterating over the old
    one is not disturbed.
    """
    entries = list(net.callbacks_)
    index = next((i for i, (_, cb) in enumerate(entries) if cb is callback), None)
    if index is None:
        return
    entry = entries.pop(index)
    if where == 'first':
        entries.insert(0, entry)
    elif where == 'last':
        position = len(entries)
        while position > 0 and isinstance(entries[position - 1][1], PrintLog):
            position -= 1
        entries.insert(position, entry)
    else:
        raise ValueError(f"where must be 'first' or 'last', got {where!r}")
    net.callbacks_ = entries

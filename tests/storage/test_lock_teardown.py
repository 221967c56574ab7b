"""A lock still held when the interpreter exits goes away silently."""

import subprocess
import sys
import textwrap

import pytest

from skorch_accel_callbacks.storage import _lock as lock, probe
from skorch_accel_callbacks.tools import inspection


@pytest.mark.slow
def test_locks_held_at_exit_end_without_a_message(tmp_path):
    # two holds of one PrefixLock (two callbacks of one job on one fn_prefix):
    # at exit the lock file is finalized before the second lock's release
    script = textwrap.dedent("""
        import sys
        from skorch_accel_callbacks.storage._lock import FolderLock, PrefixLock
        folder = FolderLock(sys.argv[1]).acquire()
        first = PrefixLock(sys.argv[1], 'train_end_').acquire()
        second = PrefixLock(sys.argv[1], 'train_end_').acquire()
        print(second.held)
    """)
    proc = subprocess.run([sys.executable, '-c', script, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == 'True\n', proc.stderr
    assert proc.stderr == ''
    # the process ended: the kernel released both locks
    assert probe(tmp_path / '.lock')['held'] is False
    assert inspection.lock_state(tmp_path)['held'] is False


def test_probe_names_the_holder_of_a_held_lock(tmp_path):
    held = lock.FolderLock(tmp_path).acquire()
    try:
        state = probe(tmp_path / '.lock')
    finally:
        held.release()
    assert state['exists'] and state['held']
    assert state['holder'].startswith('pid ') and ' on host ' in state['holder']
    assert probe(tmp_path / 'none') == {'exists': False, 'held': False, 'holder': None}

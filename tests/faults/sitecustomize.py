"""Shifts this process's wall clock by ``$PHORGE_BRIDGE_FAKE_CLOCK_OFFSET`` seconds.

Put on the ``PYTHONPATH`` of a process under test to play a host whose clock is wrong.
Only ``time.time`` and ``time.time_ns`` move; ``time.monotonic`` stays true, since
timed waits depend on it (libfaketime faking it hangs Python's timed waits).
"""

import os
import time

_offset = float(os.environ.get("PHORGE_BRIDGE_FAKE_CLOCK_OFFSET") or 0)
if _offset:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset
    time.time_ns = lambda: _time_ns() + int(_offset * 1e9)

"""One JSON line per handler run, appended to ``$PHORGE_BRIDGE_TEST_RECORD_FILE``.

Shared by the test handlers the acceptance and fault suites install in their workers
(copied beside them, since workers do not see ``tests/helpers``). Each line names the
worker (``$PHORGE_BRIDGE_TEST_WORKER``), the process and this host's time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def append(fields: dict[str, Any]) -> None:
    """Record one run; one short write to an O_APPEND file, so concurrent lines never mix."""
    line = json.dumps(
        {
            **fields,
            "worker": os.environ.get("PHORGE_BRIDGE_TEST_WORKER", "?"),
            "pid": os.getpid(),
            "time": time.time(),  # this host's clock (shifted in the clock-skew scenarios)
        }
    )
    fd = os.open(
        os.environ["PHORGE_BRIDGE_TEST_RECORD_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT
    )
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)

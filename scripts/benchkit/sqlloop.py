"""The bridge's per-task SQL in a tight loop, without Celery: one ceiling of the bench.

    BRIDGE_DATABASE_URL=... python3 -m benchkit.sqlloop --ready FILE   (hooked, see ceilings)

Lease a batch with the bridge's own lease (``bridge_api.sql_path``), execute the leased
tasks with the bridge's own execute path, a message's worth at a time as a worker runs
them, repeat until a lease comes back empty. No
broker, no message, no process hop: what is left is the database work per task, so
the bridge through Celery can approach this figure but not pass it.

The bench drives it through stdin: it starts (imports, connects, one empty lease to warm
the pool), creates the ready file, waits for a line, runs the loop, then waits for stdin
to close before exiting, so that the bench can read its CPU time while it still exists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchkit import bridge_api, hook
from benchkit.records import RecordWriter

RECORD_NAME = "sqlloop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready", required=True)
    parser.add_argument("--records", required=True)
    args = parser.parse_args()
    path = bridge_api.sql_path()
    path.lease(1)  # nothing is queued yet: builds the runtime and connects
    hook.record_runs(RecordWriter(args.records), RECORD_NAME)
    Path(args.ready).touch()
    sys.stdin.readline()
    while tasks := path.lease(path.batch):
        for outcome in path.execute(tasks):
            if outcome != "success":
                print(f"a task ended: {outcome}", file=sys.stderr, flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()

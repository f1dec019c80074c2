#!/usr/bin/env python3
"""The side choice's CPU a task (``bridge.engine.sides.choose``), as docs/benchmarks.md quotes
it: without a canary, and with the task's class shared with phd at 99.99%. In process, one
thread, no database, so the cost shows under the noise of a whole bench run:
``python3 scripts/microbench_choose.py``.
"""

import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.canary.weights import NO_CANARY, canary_of
from bridge.engine.sides import choose
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Registry

CLASS, TASKS = "PhabricatorTestWorker", 200_000
registry = Registry([PhabricatorTestWorker()])
shared = canary_of({CLASS: {"celery": 99.99}}, None)
for label, canary in (("no canary", NO_CANARY), ("class shared at 99.99%", shared)):
    runs = timeit.repeat(
        lambda canary=canary: [choose(registry, canary, CLASS, i, None) for i in range(TASKS)],
        timer=time.process_time, repeat=5, number=1,
    )  # fmt: skip
    print(f"{label}: {min(runs) / TASKS * 1e6:.2f} us a task (best of 5, {TASKS:,} tasks)")

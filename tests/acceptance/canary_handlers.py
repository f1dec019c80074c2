"""A native handler for stand-in Phorge classes, the canary's new side in
``tests/acceptance/test_canary.py``; the PHP runner (``tests/php_standin``) is the old side.

Published the way ``recording_handlers.py`` is (an entry point of a throwaway
distribution, see ``bridge_harness.write_plugin``), with a copy of
``tests/helpers/canary.py`` beside it. Each run appends a JSON line to
``$PHORGE_BRIDGE_TEST_RECORD_FILE`` (which task, which worker, when: ``run_record``).
It fails on purpose, temporarily, the tasks of the classes in ``$CANARY_FAIL_CLASSES``
whose id falls in ``$CANARY_FAIL_PERCENT`` percent (``canary.fails_on_purpose``: a hash
of the id, independent of the canary's, so that a test knows which), and only while the
file ``$CANARY_FAIL_FLAG`` exists when that is set: a handler that turns bad mid-run.
Like the PHP class it stands beside, it also fails on its task data's word
(``broken_dependency``): a dependency both sides share; and it queues the data's
``followups`` as the PHP class does, unless ``$CANARY_FORGET_FOLLOWUPS`` is set.
"""

from __future__ import annotations

import os
import random

import run_record
from canary import fails_on_purpose

from bridge.handlers.api import Handler, TaskContext, TemporaryFailure

CLASSES = ("StandinSucceedWorker", "StandinCacheWorker")


def failing(task: TaskContext) -> bool:
    classes = os.environ.get("CANARY_FAIL_CLASSES", "").split(",")
    percent = int(os.environ.get("CANARY_FAIL_PERCENT", "0"))
    if task.task_class not in classes or not fails_on_purpose(task.id, percent):
        return False
    flag = os.environ.get("CANARY_FAIL_FLAG")
    return flag is None or os.path.exists(flag)


def broken_dependency(task: TaskContext) -> bool:
    """The stand-in's StandinSucceedWorker's dependency, as the PHP side has it: it fails
    ``flake`` percent of its calls, and every call while the file ``outage`` exists."""
    data = task.data if isinstance(task.data, dict) else {}
    if random.randrange(100) < int(data.get("flake", 0)):
        return True
    outage = data.get("outage")
    return bool(outage) and os.path.exists(outage)


class CanaryNative(Handler):
    task_classes = CLASSES
    phorge_defaults = True  # standing in for Phorge classes: Phorge's waits

    def run(self, task: TaskContext) -> None:
        run_record.append({"event": "start", "id": task.id, "taskClass": task.task_class})
        if failing(task):
            raise TemporaryFailure("failing on purpose", delay=0)
        if broken_dependency(task):
            raise TemporaryFailure("the dependency failed", delay=0)
        if os.environ.get("CANARY_FORGET_FOLLOWUPS"):
            return  # the bug: PHP queues them, this handler does not
        data = task.data if isinstance(task.data, dict) else {}
        for followup in data.get("followups", []):
            task.queue_task(followup["class"], followup["data"])

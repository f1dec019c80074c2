"""Who runs a task, one name each wherever it is written: the four implementations, as
an archive row's lease owner labels them (``bridge:native:...``), the metrics'
``implementation`` label, the log line and a worker's announcement; and the two levels
at which a canary chooses between them, as the operator's weights name them
(``{"celery": 5}``), the hash of a task's side (``crc32("celery:ID")``) and the
metrics' ``level`` label.
"""

PHD = "phd"  # Phorge's PHP taskmasters (phd's, and the shipped PhorgeBridgeQueueDaemon)
RUNNER = "runner"  # Phorge's PHP, in the bridge's warm PHP processes on the worker host
CONDUIT = "conduit"  # Phorge's PHP, through the worker.execute method on Phorge's web hosts
NATIVE = "native"  # a Python handler in the bridge's worker
IMPLEMENTATIONS = (PHD, RUNNER, CONDUIT, NATIVE)

CELERY = "celery"  # which consumer takes a class's rows: phd, or Celery's workers
PYTHON = "python"  # then, in Celery's workers, which code: Phorge's PHP, or a native handler
LEVELS = (CELERY, PYTHON)

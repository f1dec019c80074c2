"""Canary: per task class, a weight says what share of its tasks the new side runs.

Two levels share one mechanism: ``celery`` (Phorge's taskmasters, or the shipped
``PhorgeBridgeQueueDaemon``, against the bridge's Celery workers) and ``python`` (the
PHP runner or Conduit against a native handler). The weights and the rollback state live in Phorge's
config table, so PHP and Python read the same values (docs/canary.md).
"""

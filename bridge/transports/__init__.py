"""The transports: how the task classes only PHP can run get run, one package each.

``php_runner`` runs them in warm PHP processes on the worker's host; ``conduit`` sends
them to Phorge's web tier through the ``worker.execute`` method the extension adds (and
holds the native feed hook, which reads its stories the same way). Both run the same
PHP task run (``PhorgeBridgeTaskRun.php``, whose protocol ``task_run`` mirrors), and
neither imports the other; the engine imports neither.
"""

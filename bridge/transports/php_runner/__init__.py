"""The PHP runner: PHP-only classes run in long-lived PHP processes on the worker's host.

``handler`` serves the classes, ``pool`` keeps a process per worker slot and retires
them by rule, ``process`` speaks to one over its pipes, ``metrics`` shows them, and
``phorge-bridge-runner.php`` is the PHP side, which bootstraps Phorge once per process.
"""

"""The machinery behind ``scripts/bench``, in the order a run uses it: ``procs`` (process
groups, CPU), ``mariadb``, ``rabbit`` and ``phorge`` (the servers, phd's Phorge and the PHP
section's), ``phorgedb`` (Phorge's tables), ``bridge_api`` (every use of the bridge's
Python API), ``records`` (what measured processes record about themselves), ``taskmaster``
(the reference), ``consumers``, ``runner`` (one measured run), ``plan`` (the scenarios),
``report`` and ``cli``. Imports go one way, down that list. Tests: ``tests/``.
"""

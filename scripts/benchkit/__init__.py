"""The machinery behind ``scripts/bench``. Imports go one way, down this list: ``procs``,
``mariadb``, ``rabbit``, ``phorge``, ``phorgedb``, ``bridge_api``, ``records``,
``taskmaster``, ``consumers``, ``runner``, ``plan``, ``report``, ``cli``. Tests: ``tests/``.
"""

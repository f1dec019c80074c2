"""The machinery behind ``scripts/bench``. Imports go one way, down this list: ``procs``,
``mariadb``, ``rabbit``, ``records``, ``bridge_api``, ``phorgedb``, ``taskmaster``,
``phorge``, ``consumers``, ``runner``, ``plan``, ``report``, ``guard_cost``, ``cli``.
Tests: ``tests/``.
"""

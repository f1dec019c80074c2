"""The machinery behind ``scripts/bench``: one benchmark of the bridge against its references.

Modules, in the order a run uses them: ``mariadb`` (the private durable server),
``phorgedb`` (Phorge's tables, enqueue, progress), ``rabbit`` (the broker), ``hook`` and
``records`` (what the measured processes record about themselves), ``procs`` (process
groups and CPU), ``consumers`` (the bridge, the reference taskmaster, phd), ``ceilings``,
``runner`` (one measured run), ``report`` (markdown) and ``cli`` (the plan). Its own tests
are in ``tests/``, run with the product's (``testpaths`` in pyproject.toml).
"""

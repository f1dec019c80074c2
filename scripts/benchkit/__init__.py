"""The machinery behind ``scripts/bench``: one benchmark of the bridge against its references.

Modules, in the order a run uses them: ``mariadb`` (the private durable server),
``phorgedb`` (Phorge's tables, enqueue, progress), ``rabbit`` (the broker), ``hook`` and
``records`` (what the measured processes record about themselves), ``procs`` (process
groups and CPU), ``consumers`` (the bridge, the reference taskmaster, phd), ``ceilings``,
``runner`` (one measured run), ``brokers`` (SQLite and Redis for issue 21's runs),
``priority`` and ``unserved`` (issue 21's runs), ``php``, ``webtier`` and
``phpconsumers`` (issue 19's PHP section: PHP-only classes on phd, the bridge's PHP runner
and Conduit), ``report`` and ``phpreport`` (markdown), ``plan`` (the scenarios) and
``cli``. Its own tests are in ``tests/``, run with the product's
(``testpaths`` in pyproject.toml).
"""

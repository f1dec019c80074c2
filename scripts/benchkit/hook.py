"""Measurement hooks loaded into the measured processes by a ``sitecustomize`` module.

The bench writes a one-line ``sitecustomize.py`` (``from benchkit import hook;
hook.install()``) into a temporary directory at the head of the processes' PYTHONPATH,
so the bridge itself is measured unmodified. In every process it:

- counts database requests where they leave the process: MySQLdb's cursor ``execute``
  (one round trip, possibly several ``;``-separated statements, split once per SQL
  text), any other ``query``, ``commit``, ``rollback``, ``ping`` (pool pre-ping) and
  ``autocommit``;
- records each finished Celery task (``task_prerun``/``task_postrun``): its first
  argument (the Phorge task id for ``bridge.execute``), start and end (``time.time()``),
  thread CPU, and the counters so far (``records.RecordWriter``); in a bridge worker
  (``BENCH_BRIDGE_RUNS``), each Phorge task it runs too, batched or not;
- writes an empty ``<ready dir>/<pid>`` once the worker is ready (Celery logs "ready."
  only at INFO, which would slow the worker down), and an empty ``<record dir>/<pid>.beat``
  in the process ``celery worker -B`` forks for beat, so its CPU is told apart.

Everything is off unless ``BENCH_RECORD_DIR`` is set, so a stray import does nothing.

Why the count wraps the driver's methods. Nothing of the bridge is patched: its runs are
timed through the engine's observer hook (``bridge_api.observe_runs``), and the Celery
tasks through Celery's signals. But no seam counts requests, and the product should not
carry one for the bench: the count must be taken the same way in every consumer (the
bridge, the reference taskmaster, the SQL loop), where the requests leave the process,
and that is MySQLdb, which has no hook of its own. So its public ``Connection`` and
``BaseCursor`` methods are wrapped, in the measured processes only. One layer up,
SQLAlchemy's engine events would miss the bridge's per-task round trips, which go
through the raw DBAPI connection (read with ``next_result``); the server's status
counters (reported beside these) cannot be split by process or task.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from benchkit.records import CounterBox, RecordWriter

RECORD_DIR_ENV = "BENCH_RECORD_DIR"
READY_DIR_ENV = "BENCH_READY_DIR"
BRIDGE_RUNS_ENV = "BENCH_BRIDGE_RUNS"  # set for bridge workers: record each Phorge task
BEAT_SUFFIX = ".beat"  # <record dir>/<pid>.beat: that process is an embedded beat

# A quoted string or identifier, backslash escapes included (unrolled: the hook runs on
# every query of the measured process, so it must cost it little).
_QUOTED = re.compile(rb"'[^'\\]*(?:\\.[^'\\]*)*'|\"[^\"\\]*(?:\\.[^\"\\]*)*\"|`[^`]*`", re.DOTALL)
_KINDS = {b"START": "begins", b"BEGIN": "begins", b"COMMIT": "commits", b"ROLLBACK": "rollbacks"}

_counters = CounterBox()
# Each task's start, by its id. No lock: a dict's set and pop are each atomic, and no
# two threads run the same task.
_started: dict[str, tuple[float, float]] = {}


def install() -> None:
    """Connect every hook, if this process is one the bench measures."""
    record_dir = os.environ.get(RECORD_DIR_ENV)
    if not record_dir:
        return
    _count_database_requests()
    writer = RecordWriter(record_dir)
    _record_celery_tasks(writer, os.environ.get(READY_DIR_ENV))
    _mark_embedded_beat(record_dir)
    if os.environ.get(BRIDGE_RUNS_ENV):
        _record_bridge_runs(writer)


def counters() -> CounterBox:
    """This process's counters (the SQL loop and the taskmaster read them in-process)."""
    return _counters


def statements(query: bytes) -> list[bytes]:
    """The ``;``-separated statements of one query (separators inside quotes ignored),
    each with its quoted strings and identifiers replaced by ``?``."""
    if b";" not in query:
        return [query]
    return [part for part in _QUOTED.sub(b"?", query).split(b";") if part.strip()]


def count_query(query: bytes | str) -> None:
    """Count one query: a round trip, and each of its statements by kind."""
    _counters.bump(_indexes(query))


def _indexes(query: bytes | str) -> tuple[int, ...]:
    """The counters one round trip of ``query`` bumps, as ``CounterBox.bump`` takes them."""
    raw = query.encode() if isinstance(query, str) else bytes(query)
    kinds = [_KINDS.get(_keyword(statement), "statements") for statement in statements(raw)]
    return CounterBox.indexes("round_trips", *kinds)


_template_indexes: dict[str, tuple[int, ...]] = {}
_TEMPLATES_KEPT = 10_000  # distinct SQL texts remembered (IN lists make some vary)


def count_template(template: str) -> None:
    """Count one cursor execute by its SQL before the parameters go in: the same
    statements (a parameter is quoted, so it adds no separator), split once per text."""
    indexes = _template_indexes.get(template)
    if indexes is None:
        indexes = _indexes(template)
        if len(_template_indexes) < _TEMPLATES_KEPT:
            _template_indexes[template] = indexes
    _counters.bump(indexes)


def _keyword(statement: bytes) -> bytes:
    words = statement.lstrip()[:20].split(None, 1)
    return words[0].upper() if words else b""


def _count_database_requests() -> None:
    """Wrap MySQLdb's Connection methods that each make one round trip to the server."""
    from MySQLdb.connections import Connection
    from MySQLdb.cursors import BaseCursor

    original_query, original_execute = Connection.query, BaseCursor.execute
    executing = threading.local()  # inside a cursor execute, counted by its template

    def query(self: Any, sql: Any) -> Any:
        if not getattr(executing, "on", False):
            count_query(sql)  # a query sent on the connection itself, not a cursor
        return original_query(self, sql)

    def execute(self: Any, sql: Any, args: Any = None) -> Any:
        if isinstance(sql, str):
            count_template(sql)
        else:  # executemany's bulk insert passes the finished query, as a bytearray
            count_query(sql)
        executing.on = True
        try:
            return original_execute(self, sql, args)
        finally:
            executing.on = False

    Connection.query = query  # type: ignore[method-assign]
    BaseCursor.execute = execute  # type: ignore[method-assign]
    for name, kind in (
        ("commit", "commits"),
        ("rollback", "rollbacks"),
        ("ping", "pings"),
        ("autocommit", "others"),
    ):
        setattr(Connection, name, _counting(getattr(Connection, name), kind))


def _counting(method: Any, kind: str) -> Any:
    indexes = CounterBox.indexes(kind, "round_trips")

    def counted(self: Any, *args: Any) -> Any:
        _counters.bump(indexes)
        return method(self, *args)

    return counted


def _record_celery_tasks(writer: RecordWriter, ready_dir: str | None) -> None:
    from celery.signals import task_postrun, task_prerun, worker_ready

    def prerun(task_id: str, **_kwargs: Any) -> None:
        _started[task_id] = (time.time(), time.thread_time())

    def postrun(task_id: str, task: Any, args: Any = None, **_kwargs: Any) -> None:
        end, cpu_end = time.time(), time.thread_time()
        start, cpu_start = _started.pop(task_id, (end, cpu_end))
        first = args[0] if args else None
        phorge_id = first if isinstance(first, int) and not isinstance(first, bool) else None
        writer.write(task.name, phorge_id, start, end, cpu_end - cpu_start, _counters.snapshot())

    def ready(**_kwargs: Any) -> None:
        if ready_dir:
            open(os.path.join(ready_dir, str(os.getpid())), "w").close()

    # weak=False: these closures have no other reference and would be collected.
    task_prerun.connect(prerun, weak=False)
    task_postrun.connect(postrun, weak=False)
    worker_ready.connect(ready, weak=False)


def _mark_embedded_beat(record_dir: str) -> None:
    """``worker -B`` forks beat as a process of its own: say which, for its CPU."""
    from celery.signals import beat_embedded_init

    def mark(**_kwargs: Any) -> None:
        open(os.path.join(record_dir, f"{os.getpid()}{BEAT_SUFFIX}"), "w").close()

    beat_embedded_init.connect(mark, weak=False)


def record_runs(writer: RecordWriter, name: str) -> None:
    """Record each Phorge task the bridge runs in this process (a Celery message may
    carry several), from its run's start to its outcome's write, as ``name``."""
    from benchkit import bridge_api

    runs: dict[int, tuple[float, float]] = {}  # unlocked, as ``_started``

    def started(task_id: int) -> None:
        runs[task_id] = (time.time(), time.thread_time())

    def ended(task_id: int) -> None:
        end, cpu_end = time.time(), time.thread_time()
        start, cpu_start = runs.pop(task_id, (end, cpu_end))
        writer.write(name, task_id, start, end, cpu_end - cpu_start, _counters.snapshot())

    bridge_api.observe_runs(started, ended)


def _record_bridge_runs(writer: RecordWriter) -> None:
    """In a bridge worker, :func:`record_runs` as ``bridge_api.RUN_RECORD``."""
    from celery.signals import worker_init

    from benchkit import bridge_api

    # In the worker's main process, before the pool forks its children.
    worker_init.connect(lambda **_: record_runs(writer, bridge_api.RUN_RECORD), weak=False)

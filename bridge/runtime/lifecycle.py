"""Worker lifecycle hooks: task tags on log lines, metrics counted across the pool's
processes and exported at start, Conduit's request slots shared by the pool, the
transports started with the pool's processes (the PHP runner's) and stopped with them,
lease hand-back at
warm shutdown; connected for an app by :func:`install`."""

from __future__ import annotations

import logging
import os

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker import state
from prometheus_client.registry import Collector

from bridge.assembly import check_canary, runtime
from bridge.config import current_settings
from bridge.engine.tracing import tag_log_lines
from bridge.errors import ConfigError
from bridge.handlers.capabilities import TransportHandler
from bridge.metrics.canary import CanaryCollector
from bridge.metrics.exporter import (
    MULTIPROC_DIR,
    ProcessesCollector,
    count_across_processes,
    serve,
)
from bridge.metrics.queue import QueueCollector
from bridge.queue import Lease
from bridge.runtime.consumers import ConsumersCollector, ConsumerWatch, fleet_survey
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK
from bridge.transports.conduit import request_slots

log = logging.getLogger(__name__)


def tag_task_log_lines(logger: logging.Logger, **_kwargs: object) -> None:
    """Every line logged while a task runs names it (id, class, owner, traceparent)."""
    tag_log_lines(logger)


def count_in_children(**_kwargs: object) -> None:
    """A worker that serves metrics counts in files before its pool forks, so that the
    exporter sees what the prefork children count (without it, it saw nothing)."""
    if current_settings().metrics_port:
        directory = count_across_processes()
        log.debug("metrics: the pool's processes count in %s", directory)


def check_canary_at_start(**_kwargs: object) -> None:
    """A worker whose canary weights are bad, or name a share it cannot run (a native
    weight below 100 for a class it has no PHP path for), stops at start, naming
    ``phorge-bridge.canary`` and the class, as a bad setting does. A database it cannot
    read yet does not stop it: the weights are read again before each task."""
    try:
        check_canary(runtime())
    except ConfigError as exc:
        # A receiver's exception is only logged by Celery's signals; an exit is not.
        raise SystemExit(f"Error: configuration error: {exc}") from None
    except Exception as exc:
        log.warning("canary: the weights could not be checked at start: %s", exc)


def share_conduit_slots(**_kwargs: object) -> None:
    """Make the worker's Conduit request slots before its pool forks, so that the bound
    is the worker's, not each child's."""
    if current_settings().conduit is not None:
        request_slots.share_with_pool()


def start_metrics(app: Celery) -> None:
    rt = runtime()
    settings = rt.settings
    if settings.metrics_port:
        watch = ConsumerWatch(
            lambda known: fleet_survey(app, rt.queue.stats(), rt.registry, settings, known)
        )
        ports, address = settings.metrics_port, settings.metrics_address
        queue_figures = QueueCollector(
            rt.queue,
            rt.registry,
            settings.router,
            settings.owner_prefix,
            fleet=watch.served,
            canary=rt.canary,
        )
        collectors: list[Collector] = [
            ProcessesCollector(os.environ[MULTIPROC_DIR]),  # set by count_in_children
            queue_figures,
            ConsumersCollector(watch),
        ]
        if settings.canary:
            collectors.append(CanaryCollector.for_settings(rt.queue.engine, settings))
        try:
            port = serve(ports, address, *collectors)
        except OSError as exc:
            port, reason = None, exc.strerror
        else:
            reason = "address already in use"
        if port is None:
            shown = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
            log.error(
                "metrics: not served, no port of BRIDGE_METRICS_PORT=%s is free on %s (%s); "
                "give each worker on this host a port of its own, e.g. a range",
                shown,
                address,
                reason,
            )
        else:
            log.info("metrics on %s:%d", address, port)


def prefork(worker: object) -> bool:
    """Whether the worker's tasks run in forked children (which start runners of their
    own) rather than in this process."""
    pool = getattr(worker, "pool_cls", None)
    return "prefork" in str(getattr(pool, "__module__", pool))


def transports() -> list[TransportHandler]:
    return [h for h in runtime().registry.handlers() if isinstance(h, TransportHandler)]


def start_transports(slots: int) -> None:
    """Get this process's transports ready for ``slots`` tasks at once (the PHP runner
    boots a process per slot), so no first task waits."""
    for transport in transports():
        transport.start(slots)


def start_transports_of_worker(sender: object = None, **_kwargs: object) -> None:
    """A threads or solo worker runs tasks in this process: ready for every thread."""
    if sender is not None and not prefork(sender):
        start_transports(int(getattr(sender, "concurrency", 1) or 1))


def stop_transports(**_kwargs: object) -> None:
    for transport in transports():
        transport.stop()


def stop_transports_of_worker(sender: object = None, **_kwargs: object) -> None:
    if sender is not None and not prefork(sender):
        stop_transports()


def unstarted_leases() -> list[Lease]:
    """Leases of the tasks in messages this worker holds but has not started."""
    leases = []
    for request in set(state.reserved_requests) - set(state.active_requests):
        args = request.args
        if request.name == EXECUTE_TASK and len(args) >= 3:
            leases.append(Lease(*args[:3]))
        elif request.name == EXECUTE_BATCH and len(args) >= 2:
            leases.extend(Lease(task[0], args[0], task[1]) for task in args[1])
    return leases


def free_unstarted() -> int:
    """Hand back unstarted leases so another worker runs them at once, not after expiry."""
    freed = 0
    for lease in unstarted_leases():
        try:
            freed += runtime().queue.free_own([lease.task_id], lease.owner)
        except Exception as exc:  # shutting down: the lease will expire on its own
            log.warning("could not free the lease of task %s: %s", lease.task_id, exc)
    return freed


def hand_back_leases(**_kwargs: object) -> None:
    freed = free_unstarted()
    if freed:
        log.info("handed back %d unstarted lease(s)", freed)


def install(app: Celery) -> None:
    """Connect the hooks for workers of ``app``."""
    after_setup_logger.connect(tag_task_log_lines, weak=False)
    after_setup_task_logger.connect(tag_task_log_lines, weak=False)
    worker_init.connect(count_in_children, weak=False)
    worker_init.connect(share_conduit_slots, weak=False)
    worker_ready.connect(lambda **_: start_metrics(app), weak=False)
    worker_shutting_down.connect(hand_back_leases, weak=False)
    # After the metrics' switch to counting across processes: the check builds the runtime.
    worker_init.connect(check_canary_at_start, weak=False)
    worker_init.connect(start_transports_of_worker, weak=False)
    worker_process_init.connect(lambda **_: start_transports(1), weak=False)
    worker_process_shutdown.connect(stop_transports, weak=False)
    worker_shutdown.connect(stop_transports_of_worker, weak=False)

"""The canary's figures per class and level, read at each scrape: the weights in
force and the rollbacks (Phorge's config table), and both sides' runs over the guard's
window (Phorge's archive, so the phd side is counted too, not only the bridge's runs).

Served beside the queue's gauges (``bridge.runtime.lifecycle``): every worker that
serves metrics reads the same rows, hence ``max by`` over workers in the shipped rules
and dashboard. Without a canary (neither option set, or no class named) it yields
nothing and reads no archive row: one read of the two option rows a scrape. The
rolled-back gauge is the state row's alone: it stays while the operator's weights are
refused, so its alert does not resolve while the class is still rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from bridge.canary.guard import read_windows
from bridge.canary.store import CanaryStore, decode_state, decode_weights
from bridge.canary.weights import NEW, OLD, OPTION, STATE_OPTION, Canary, parse_weights, percent
from bridge.config import Settings
from bridge.errors import ConfigError
from bridge.queue.implementations import LEVELS

log = logging.getLogger(__name__)
T = TypeVar("T")

WEIGHT = "phorge_bridge_canary_weight"
ROLLED_BACK = "phorge_bridge_canary_rolled_back"
RUNS = "phorge_bridge_canary_runs"
SUCCESS_RATIO = "phorge_bridge_canary_success_ratio"
DURATION = "phorge_bridge_canary_duration_seconds"
FALLBACKS = "phorge_bridge_canary_fallbacks"
NAMES = (WEIGHT, ROLLED_BACK, RUNS, SUCCESS_RATIO, DURATION, FALLBACKS)
QUANTILES = (("0.5", "p50"), ("0.99", "p99"))
SIDES = (NEW, OLD)


def watched(canary: Canary) -> list[tuple[str, str]]:
    """``(class, level)`` whose two sides are compared: those shared now (0 < weight <
    100), and those rolled back (by the guard or ``canary rollback``), whose window
    still shows why."""
    pairs = [(task_class, level) for task_class, level, _ in canary.partial()]
    for task_class in canary.named:
        for level in LEVELS:
            state = canary.state.of(task_class, level)
            if state.rolled_back and (task_class, level) not in pairs:
                pairs.append((task_class, level))
    return pairs


class CanaryCollector:
    """Gauges of the canary per named class and level, read at each scrape."""

    def __init__(self, store: CanaryStore, engine: Engine, window: int, window_runs: int) -> None:
        """``engine`` reaches the worker database (the archive); ``window`` and
        ``window_runs`` are the guard's (``BRIDGE_CANARY_WINDOW``, ``_WINDOW_RUNS``)."""
        self.store, self.engine = store, engine
        self.window, self.window_runs = window, window_runs
        self._refused: set[str] = set()  # the problems the last scrape logged
        self._refusing: set[str] = set()

    @classmethod
    def for_settings(cls, engine: Engine, settings: Settings) -> CanaryCollector:
        store = CanaryStore.for_settings(engine, settings)
        return cls(store, engine, settings.canary_window, settings.canary_window_runs)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self._refusing = set()
        values = self._said(lambda: self.store.read_values() or {})
        state = weights = None
        if values is not None:
            state = self._said(lambda: decode_state(values.get(STATE_OPTION)))
            weights = self._said(lambda: parse_weights(decode_weights(values.get(OPTION))))
        self._refused, self._refusing = self._refusing, set()
        if state is None:
            return  # nothing is known of the rollbacks
        if weights is None:
            if state.levels:  # the rollbacks are the state's, whatever the weights say
                yield self.rolled_back(Canary(state=state))
            return
        canary = Canary(weights, state)
        if canary.named:
            yield self.weight(canary)
            yield self.rolled_back(canary)
            yield from self.sides(watched(canary))

    def _said(self, read: Callable[[], T]) -> T | None:
        """``read()``; None (logged once, until it reads again) while Phorge's config
        table cannot be read (``{namespace}_config`` is another database, which the
        bridge's user may not be granted) or a value is refused: the canary must not
        cost the scrape every other figure."""
        try:
            return read()
        except (ConfigError, ValueError, DBAPIError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem not in self._refused:
                log.warning(
                    "canary metrics: not all served, %s cannot be read: %s",
                    self.store.table_name,
                    problem,
                )
            self._refusing.add(problem)
            return None

    def weight(self, canary: Canary) -> GaugeMetricFamily:
        weight = GaugeMetricFamily(
            WEIGHT,
            "Percent of the class's tasks the new side of the level runs (celery: the "
            "bridge's workers, not phd; python: a native handler, not PHP), after ramp and "
            "rollback",
            labels=["task_class", "level"],
        )
        for task_class in canary.named:
            for level in LEVELS:
                weight.add_metric([task_class, level], percent(canary.weight(task_class, level)))
        return weight

    def rolled_back(self, canary: Canary) -> GaugeMetricFamily:
        """From the state row alone, whether or not the weights are readable."""
        rolled_back = GaugeMetricFamily(
            ROLLED_BACK,
            "1 while the class is rolled back at the level (weight 0 until "
            "`phorge-bridge canary promote`), else 0",
            labels=["task_class", "level"],
        )
        for task_class in canary.named:
            for level in LEVELS:
                state = canary.state.of(task_class, level)
                rolled_back.add_metric([task_class, level], int(state.rolled_back))
        return rolled_back

    def sides(self, pairs: list[tuple[str, str]]) -> Iterator[GaugeMetricFamily]:
        """Each side's runs of the guard's window, from Phorge's archive (one read for
        all the pairs, as the guard's)."""
        by_side = ["task_class", "level", "side"]
        runs = GaugeMetricFamily(
            RUNS,
            f"Runs of the class by each side of the level archived in the last {self.window} s "
            "(BRIDGE_CANARY_WINDOW), phd's included; a fallback counts on both sides",
            labels=by_side,
        )
        ratio = GaugeMetricFamily(
            SUCCESS_RATIO,
            f"Share (0..1) of each side's runs of the last {self.window} s that succeeded "
            "(absent without runs)",
            labels=by_side,
        )
        duration = GaugeMetricFamily(
            DURATION,
            f"Run time of each side's successful runs of the last {self.window} s, as archived",
            labels=[*by_side, "quantile"],
        )
        fallbacks = GaugeMetricFamily(
            FALLBACKS,
            f"New-side runs of the last {self.window} s that failed and fell back to the old side",
            labels=["task_class", "level"],
        )
        asked = [(task_class, level, self.window) for task_class, level in pairs]
        for window in read_windows(self.engine, asked, self.window_runs):
            task_class, level = window.task_class, window.level
            for side, figures in zip(SIDES, (window.new, window.old), strict=True):
                labels = [task_class, level, side]
                runs.add_metric(labels, figures.runs)
                if figures.ratio is not None:
                    ratio.add_metric(labels, figures.ratio)
                for quantile, attribute in QUANTILES:
                    seconds = getattr(figures, attribute)
                    if seconds is not None:
                        duration.add_metric([*labels, quantile], seconds)
            fallbacks.add_metric([task_class, level], window.new.fallbacks)
        yield runs
        yield ratio
        yield duration
        yield fallbacks

"""Where the canary's weights and state are kept: two rows of Phorge's config table.

``phorge-bridge.canary`` (the operator's weights, ``bin/config set --database``) and
``phorge-bridge.canary-state`` (written here only: rollbacks, ramp steps, history) are
rows of ``{namespace}_config.config_entry``, their values JSON, as PhabricatorConfigEntry
stores them, so PHP reads them with Phorge's own config stack and ``bin/config get``
shows them. :class:`CanaryStore` reads and writes them; :class:`CanaryView` is what a
worker, a poll or a beat consults: the last values read, at most ``refresh`` s old.

Where the table is: ``BRIDGE_CANARY_DATABASE`` when set; else, when the worker
database is named ``{namespace}_worker``, ``{namespace}_config`` beside it (the way
doctor finds ``{namespace}_daemon``); else (SQLite, the tests' databases) the worker
database itself. A missing table is no canary at all (every class wholly on the new
side, today's behaviour), said once in a WARNING naming the table.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from bridge.canary import sql
from bridge.canary.weights import (
    CLOSED,
    NO_CANARY,
    OPTION,
    STATE_OPTION,
    Canary,
    CanaryState,
    parse_weights,
)
from bridge.errors import ConfigError
from bridge.queue.retry import retrying
from bridge.queue.schema import beside, config_entry_in

if TYPE_CHECKING:
    from bridge.config import Settings

log = logging.getLogger(__name__)

# Phorge's PHIDs: PhabricatorPHID::generateNewPHID('CONF') draws 20 characters with
# Filesystem::readRandomCharacters(), from this alphabet.
PHID_PREFIX = "PHID-CONF-"
PHID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
PHID_LENGTH = 20

# MySQL's "table doesn't exist" and "unknown database".
_MISSING_TABLE_CODES = (1146, 1049)
_INSERT_RACES = 5  # two first writers both insert; the loser reads the winner's row


def new_phid() -> str:
    """A fresh config entry PHID: ``PHID-CONF-`` and 20 random characters."""
    return PHID_PREFIX + "".join(secrets.choice(PHID_ALPHABET) for _ in range(PHID_LENGTH))


def config_database(engine: Engine, override: str | None) -> str | None:
    """The database holding Phorge's ``config_entry`` for the worker database of
    ``engine`` (see the module's docstring); None: the worker database itself."""
    if engine.dialect.name == "sqlite":
        return None
    return override or beside(engine.url.database, "config")


def encode(value: Any) -> str:
    """An option's value as Lisk's SERIALIZATION_JSON stores it (``json_encode``)."""
    return json.dumps(value, separators=(",", ":"))


def missing_table(exc: DBAPIError) -> bool:
    """Whether ``exc`` says the config table (or its database) does not exist."""
    orig = exc.orig
    if orig is not None and type(orig).__module__.startswith("MySQLdb"):
        return bool(orig.args) and orig.args[0] in _MISSING_TABLE_CODES
    return "no such table" in str(orig)


PHP_JSON_DEPTH = 511  # the arrays json_decode() nests at its default depth (512)


def _php_array(pairs: list[tuple[str, Any]]) -> Any:
    # An object keyed "0", "1", ... in order is a list once PHP has decoded it.
    value = dict(pairs)
    if value and list(value) == [str(n) for n in range(len(value))]:
        return list(value.values())
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_PHP_DECODER = json.JSONDecoder(object_pairs_hook=_php_array, parse_constant=_refuse_constant)


def php_json(raw: str) -> Any:
    """``raw`` decoded as PHP's ``json_decode($raw, true)`` decodes it, so that both sides
    judge the same value: objects keyed 0, 1, ... become lists; NaN and Infinity, lone
    UTF-16 surrogates and arrays nested deeper than 511 are refused (ValueError)."""
    try:
        value = _PHP_DECODER.decode(raw)
    except RecursionError:
        raise ValueError(f"nested deeper than {PHP_JSON_DEPTH} arrays") from None
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= PHP_JSON_DEPTH:
                raise ValueError(f"nested deeper than {PHP_JSON_DEPTH} arrays")
            for key, entry in item.items() if isinstance(item, dict) else enumerate(item):
                stack += [(key, depth), (entry, depth + 1)]
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a lone UTF-16 surrogate") from None
    return value


def read_json(option: str, raw: str | None) -> Any:
    """An option's raw value (None: no row) decoded by :func:`php_json`; raises
    ConfigError naming the option."""
    if raw is None:
        return None
    try:
        return php_json(raw)
    except ValueError as exc:
        raise ConfigError(option, f"not JSON: {exc}") from None


def decode_weights(raw: str | None) -> Any:
    return read_json(OPTION, raw)


def decode_state(raw: str | None) -> CanaryState:
    """The state option's value; raises ConfigError when the bridge did not write it."""
    if raw is None:
        return CanaryState()
    try:
        return CanaryState.from_json(php_json(raw))
    except ValueError as exc:
        raise ConfigError(
            STATE_OPTION,
            f"not the bridge's state ({exc}); `./bin/config delete --database "
            f"{STATE_OPTION}` forgets every rollback",
        ) from None


class CanaryStore:
    """The two options in ``config_entry`` of ``database`` (None: the engine's own)."""

    def __init__(self, engine: Engine, database: str | None, *, warn_missing: bool = True) -> None:
        self.engine = engine
        self.database = database
        self.table = config_entry_in(database)
        self._missing_said = not warn_missing  # doctor says it in its own words
        self._warn_missing = warn_missing

    @classmethod
    def for_settings(
        cls, engine: Engine, settings: Settings, *, warn_missing: bool = True
    ) -> CanaryStore:
        database = config_database(engine, settings.canary_database)
        return cls(engine, database, warn_missing=warn_missing)

    @property
    def table_name(self) -> str:
        """The table as an operator would name it: ``bridgeinterop_config.config_entry``."""
        return f"{self.database}.{self.table.name}" if self.database else self.table.name

    def read_values(self, conn: Connection | None = None) -> dict[str, str] | None:
        """The two options' raw JSON values present (deleted rows are absent); None when
        the table does not exist (logged once)."""
        query = sql.read_options(self.table, (OPTION, STATE_OPTION))
        try:
            if conn is None:
                with self.engine.connect() as own:
                    rows = own.execute(query).all()
            else:
                rows = conn.execute(query).all()
        except DBAPIError as exc:
            if not missing_table(exc):
                raise
            if not self._missing_said:
                self._missing_said = True
                log.warning(
                    "canary: Phorge's config table %s does not exist: no canary, every "
                    "class runs wholly on the new side (BRIDGE_CANARY_DATABASE names "
                    "another database)",
                    self.table_name,
                )
            return None
        self._missing_said = not self._warn_missing
        return {str(key): str(value) for key, value in rows}

    def read(self) -> Canary:
        """The canary in force now, read fresh; NO_CANARY when neither row (or the
        table) exists. Raises ConfigError for bad weights or a state not the bridge's."""
        values = self.read_values()
        if not values:
            return NO_CANARY
        weights = parse_weights(decode_weights(values.get(OPTION)))
        return Canary(weights, decode_state(values.get(STATE_OPTION)))

    def set_weights(self, value: Mapping[str, Any]) -> None:
        """Write the operator's option, as ``bin/config set --database`` would (refusing
        weights the bridge, or PHP, would refuse once read back)."""
        raw = encode(value)
        parse_weights(decode_weights(raw))
        self._write(OPTION, lambda _raw: raw)

    def edit_weights(self, change: Callable[[Any], dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        """Apply ``change`` to the operator's option (its value as PHP decodes it) in one
        transaction, the row locked FOR UPDATE, so that neither a concurrent edit nor a
        ``bin/config set`` is lost. Raises ConfigError, writing nothing, when ``change``
        refuses, when its result is not weights the bridge and PHP accept, or when the
        value as it stands is refused (``bin/config set`` fixes that). Returns the value
        before and after; no ``config_transaction`` row, so phd's daemons stay up."""
        result: list[tuple[Any, dict[str, Any]]] = []

        def rewrite(raw: str | None) -> str | None:
            before = decode_weights(raw)
            parse_weights(before)
            after = change(before)
            parse_weights(after)
            result[:] = [(before, after)]
            return None if after == before else encode(after)

        self._write(OPTION, rewrite)
        return result[0]

    def change_state(self, change: Callable[[CanaryState], CanaryState]) -> CanaryState:
        """Apply ``change`` to the state in one transaction, the row locked FOR UPDATE
        (inserted when absent), so two writers never lose each other's change. ``change``
        may be called more than once (a transaction is retried after a deadlock); it
        returns its argument unchanged to write nothing. Returns the state written."""
        result: list[CanaryState] = []

        def rewrite(raw: str | None) -> str | None:
            current = decode_state(raw)
            changed = change(current)
            result[:] = [changed]
            return None if changed == current else encode(changed.to_json())

        self._write(STATE_OPTION, rewrite)
        return result[0]

    def _write(self, key: str, rewrite: Callable[[str | None], str | None]) -> None:
        """``rewrite(old JSON or None)`` into ``key``'s row (None: leave it as it is)."""

        def attempt() -> None:
            with self.engine.connect() as conn:
                conn.execution_options(bridge_write=True)  # SQLite: BEGIN IMMEDIATE
                with conn.begin():
                    row = conn.execute(sql.lock_option(self.table, key)).one_or_none()
                    old = None if row is None or row.isDeleted else str(row.value)
                    new = rewrite(old)
                    if new is None:
                        return
                    if row is None:
                        conn.execute(sql.insert_option(self.table, key, new, new_phid()))
                    else:
                        conn.execute(sql.update_option(self.table, row.id, new))

        for race in range(1, _INSERT_RACES + 1):
            try:
                retrying(f"canary: write {key}", attempt)
                return
            except IntegrityError:
                # Two first writers: the other inserted the row meanwhile; lock it now.
                if race == _INSERT_RACES:
                    raise


class CanaryView:
    """The canary as a worker, a poll or a beat sees it: read at most every ``refresh``
    seconds. It fails closed: while the options cannot be read (a lost grant, a database
    that does not answer), the last good canary runs :meth:`~Canary.closed` (and
    :data:`CLOSED` before any good read), so a rollback written meanwhile is never run
    past; refused values (an operator's typo) keep the last good ones in force. Each
    problem is logged once, as PHP's ``PhorgeBridgeCanary::refresh()`` does."""

    def __init__(self, store: CanaryStore, refresh: float) -> None:
        self.store = store
        self.refresh = refresh
        self._good: Canary = CLOSED  # the last canary read and accepted
        self._value: Canary = CLOSED
        self._read_at: float | None = None
        self._reads = 0  # how many reads were made: a thread that waited reads no more
        self._problem: str | None = None
        self._lock = threading.Lock()

    def current(self) -> Canary:
        read_at, reads = self._read_at, self._reads
        if read_at is not None and time.monotonic() - read_at < self.refresh:
            return self._value
        # The first read is waited for; later, one thread reads while the others go on
        # with the value it replaces.
        if not self._lock.acquire(blocking=read_at is None):
            return self._value
        try:
            if self._reads == reads:
                self._reread()
            return self._value
        finally:
            self._lock.release()

    def _reread(self) -> None:
        try:
            value = self.store.read()
        except ConfigError as exc:
            self._value = self._good
            self._said(exc, logging.ERROR, "keeping the last good ones")
        except Exception as exc:
            never = self._good is CLOSED
            self._value = self._good.closed()
            self._said(
                exc,
                logging.ERROR if never else logging.WARNING,
                "never read: no task runs here until they are read (the bridge's account "
                "needs SELECT on the table, or BRIDGE_CANARY=false)"
                if never
                else "no task of a shared class runs on the new side until they are read again",
            )
        else:
            if self._problem is not None:
                log.info("canary: the weights in %s are readable again", self.store.table_name)
            self._problem = None
            self._good = self._value = value
        self._read_at = time.monotonic()
        self._reads += 1

    def _said(self, exc: Exception, level: int, meanwhile: str) -> None:
        """Log ``exc`` once (until another problem, or a good read)."""
        problem = f"{type(exc).__name__}: {exc}"
        if problem != self._problem:
            log.log(
                level,
                "canary: cannot read the weights from %s, %s: %s",
                self.store.table_name,
                meanwhile,
                problem,
            )
        self._problem = problem

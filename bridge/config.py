"""Settings: every ``BRIDGE_*`` environment variable, parsed, validated and explained.

A bad value stops the process at start with the setting's name and what is accepted;
an unknown ``BRIDGE_`` name is refused too, since a typo would otherwise be ignored.
Secrets (the Conduit token) come from the environment or a file and are never shown.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bridge.conduit import ConduitSettings, validate_token
from bridge.routing import QUEUE_NAME, Router

DATABASE_SCHEMES = ("mysql", "mysql+mysqldb", "mariadb", "mariadb+mysqldb", "sqlite")
# A queue dispatches at most this many tasks per poll: 200 a second at the default
# interval, while a backlog a worker cannot start within the dispatch lease stays small.
DEFAULT_MAX_INFLIGHT = 200
MAX_OWNER_PREFIX = 24  # leaves room for ":pid:time:host:sequence" in varchar(64)
BROKER_SCHEMES = ("amqp", "pyamqp", "amqps", "redis", "rediss", "sqla+sqlite")


class ConfigError(ValueError):
    """A setting that cannot be used; ``str()`` names it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.setting = name


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    help: str
    secret: bool = False


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "BRIDGE_DATABASE_URL",
        "sqlite:///phorge-bridge.db",
        "Phorge's worker database (SQLAlchemy URL), e.g. "
        "mysql+mysqldb://user:pass@127.0.0.1/phabricator_worker",
    ),
    Setting(
        "BRIDGE_BROKER_URL",
        "sqla+sqlite:///phorge-bridge-broker.db",
        "Celery broker: amqp://, redis:// or the server-less sqla+sqlite://",
    ),
    Setting("BRIDGE_POLL_INTERVAL", "1", "seconds between two polls of the queue"),
    Setting(
        "BRIDGE_ROUTES",
        "",
        "ordered rules 'glob=queue,...' from task class to Celery queue; first match wins",
    ),
    Setting("BRIDGE_DEFAULT_QUEUE", "phorge", "queue of classes no rule matches"),
    Setting("BRIDGE_CONTROL_QUEUE", "bridge.control", "queue of the bridge.poll messages"),
    Setting(
        "BRIDGE_MAX_INFLIGHT",
        str(DEFAULT_MAX_INFLIGHT),
        "leases held at once per queue: 'N' for every queue, or 'N,queue=M,...'",
    ),
    Setting(
        "BRIDGE_DISPATCH_LEASE",
        "300",
        "seconds a dispatched task stays leased before a worker starts it",
    ),
    Setting(
        "BRIDGE_DEFAULT_LEASE",
        "7200",
        "seconds of lease a running task holds when its handler declares none "
        "(renewed by the heartbeat)",
    ),
    Setting("BRIDGE_RETRY_BASE", "15", "first wait (s) after a native handler's failure"),
    Setting("BRIDGE_RETRY_MAX", "3600", "longest wait (s) between retries of native handlers"),
    Setting("BRIDGE_RETRY_JITTER", "0.2", "random fraction (0..1) added to each retry wait"),
    Setting(
        "BRIDGE_REPORT_ATTEMPTS",
        "5",
        "tries to write an outcome through database errors before the lease is left to expire",
    ),
    Setting("BRIDGE_HANDLERS_INCLUDE", "*", "globs of task classes the bridge may serve"),
    Setting("BRIDGE_HANDLERS_EXCLUDE", "", "globs of task classes the bridge never serves"),
    Setting("BRIDGE_OWNER_PREFIX", "bridge", "start of every lease owner this bridge writes"),
    Setting(
        "BRIDGE_INLINE_DATA_MAX",
        "8192",
        "task data up to this many bytes travels inside the Celery message",
    ),
    Setting("BRIDGE_TASK_EVENTS", "true", "send Celery task events (for Flower)"),
    Setting("BRIDGE_METRICS_PORT", "", "serve Prometheus metrics on this port (off when empty)"),
    Setting("BRIDGE_METRICS_ADDRESS", "127.0.0.1", "address the metrics server binds"),
    Setting("BRIDGE_CONDUIT_URL", "", "Phorge base URL; enables the worker.execute proxy"),
    Setting("BRIDGE_CONDUIT_TOKEN", "", "Conduit API token of the bridge's bot", secret=True),
    Setting("BRIDGE_CONDUIT_TOKEN_FILE", "", "file holding the Conduit API token"),
    Setting("BRIDGE_CONDUIT_CONNECT_TIMEOUT", "5", "seconds to connect to Conduit"),
    Setting("BRIDGE_CONDUIT_READ_TIMEOUT", "600", "seconds to wait for a Conduit answer"),
    Setting("BRIDGE_CONDUIT_VERIFY_TLS", "true", "verify Conduit's TLS certificate"),
)
KNOWN = {setting.name for setting in SETTINGS}


@dataclass(frozen=True)
class MaxInflight:
    default: int
    per_queue: Mapping[str, int] = field(default_factory=dict)

    def for_queue(self, queue: str) -> int:
        return self.per_queue.get(queue, self.default)


@dataclass(frozen=True)
class Settings:
    database_url: str
    broker_url: str
    poll_interval: float
    router: Router
    control_queue: str
    max_inflight: MaxInflight
    dispatch_lease: int
    default_lease: int
    retry_base: int
    retry_max: int
    retry_jitter: float
    report_attempts: int
    handlers_include: tuple[str, ...]
    handlers_exclude: tuple[str, ...]
    owner_prefix: str
    inline_data_max: int
    task_events: bool
    metrics_port: int | None
    metrics_address: str
    conduit: ConduitSettings | None


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, f"expected a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(name, f"expected a positive integer, got {raw!r}")
    return value


def _port(name: str, raw: str) -> int:
    port = _positive_int(name, raw)
    if port > 65535:
        raise ConfigError(name, f"expected a TCP port from 1 to 65535, got {raw!r}")
    return port


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, f"expected a positive number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(name, f"expected a positive number of seconds, got {raw!r}")
    return value


def _fraction(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise ConfigError(name, f"expected a number from 0 to 1, got {raw!r}")
    return value


def _boolean(name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(name, f"expected true or false, got {raw!r}")


def _url(name: str, raw: str, schemes: tuple[str, ...]) -> str:
    scheme = urlsplit(raw).scheme if "://" in raw else ""
    if scheme not in schemes:
        shown = raw.split("://")[0] + "://..." if "://" in raw else repr(raw)
        raise ConfigError(name, f"unsupported URL {shown}; accepted schemes: {', '.join(schemes)}")
    return raw


def _globs(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _max_inflight(name: str, raw: str) -> MaxInflight:
    default: int | None = None
    per_queue: dict[str, int] = {}
    for part in _globs(raw):
        queue, sep, number = part.rpartition("=")
        if not sep:
            default = _positive_int(name, number)
        elif not queue.strip():
            raise ConfigError(name, f"expected 'N' or 'queue=N', got {part!r}")
        else:
            per_queue[queue.strip()] = _positive_int(name, number)
    return MaxInflight(DEFAULT_MAX_INFLIGHT if default is None else default, per_queue)


def _conduit(env: Mapping[str, str], get: Callable[..., Any]) -> ConduitSettings | None:
    """The Conduit proxy's settings, or None when it is off; URL and token go together."""
    url = env.get("BRIDGE_CONDUIT_URL", "").strip()
    token, token_name = env.get("BRIDGE_CONDUIT_TOKEN", "").strip(), "BRIDGE_CONDUIT_TOKEN"
    token_file = env.get("BRIDGE_CONDUIT_TOKEN_FILE", "").strip()
    if token and token_file:
        raise ConfigError("BRIDGE_CONDUIT_TOKEN_FILE", "set either it or BRIDGE_CONDUIT_TOKEN")
    if token_file:
        token_name = "BRIDGE_CONDUIT_TOKEN_FILE"
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(token_name, f"cannot read {token_file}: {exc.strerror}") from None
    if not url:
        if token:
            raise ConfigError("BRIDGE_CONDUIT_URL", "required when a Conduit token is configured")
        return None
    if not token:
        raise ConfigError(
            "BRIDGE_CONDUIT_TOKEN",
            "BRIDGE_CONDUIT_URL is set, so a token (or its file) is required",
        )
    try:
        return ConduitSettings(
            url=url,
            token=validate_token(token, token_name),
            connect_timeout=get("BRIDGE_CONDUIT_CONNECT_TIMEOUT", _positive_float),
            read_timeout=get("BRIDGE_CONDUIT_READ_TIMEOUT", _positive_float),
            verify_tls=get("BRIDGE_CONDUIT_VERIFY_TLS", _boolean),
        )
    except ConfigError:
        raise
    except ValueError as exc:  # conduit's checks name the setting first: "NAME: problem"
        name, _, problem = str(exc).partition(": ")
        raise ConfigError(name, problem) from None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every setting; raises ConfigError naming the first bad one."""
    env = dict(os.environ if environ is None else environ)
    unknown = sorted(name for name in env if name.startswith("BRIDGE_") and name not in KNOWN)
    if unknown:
        raise ConfigError(unknown[0], "unknown setting; see the README's settings table")

    def get(name: str, parse: Callable[[str, str], Any] | None = None) -> Any:
        raw = env.get(name)
        if raw is None or raw == "":
            raw = next(s.default for s in SETTINGS if s.name == name)
        return raw if parse is None else parse(name, raw)

    default_queue = get("BRIDGE_DEFAULT_QUEUE")
    if not QUEUE_NAME.match(default_queue):
        raise ConfigError("BRIDGE_DEFAULT_QUEUE", f"malformed queue name {default_queue!r}")
    control_queue = get("BRIDGE_CONTROL_QUEUE")
    if not QUEUE_NAME.match(control_queue) or control_queue == default_queue:
        raise ConfigError(
            "BRIDGE_CONTROL_QUEUE", "needs a queue name of its own (letters, digits, _ . : -)"
        )
    try:
        router = Router.parse(get("BRIDGE_ROUTES"), default_queue)
    except ValueError as exc:
        raise ConfigError("BRIDGE_ROUTES", str(exc)) from None
    if control_queue in router.queues:
        raise ConfigError("BRIDGE_ROUTES", f"routes a class to the control queue {control_queue!r}")
    prefix = get("BRIDGE_OWNER_PREFIX")
    # No colon: "prefix:" must select this bridge's owners and no other's.
    if not prefix or len(prefix) > MAX_OWNER_PREFIX or ":" in prefix:
        raise ConfigError(
            "BRIDGE_OWNER_PREFIX",
            f"must be short (1 to {MAX_OWNER_PREFIX} characters) and hold no ':'",
        )
    metrics_port = env.get("BRIDGE_METRICS_PORT", "")
    settings = Settings(
        database_url=get("BRIDGE_DATABASE_URL", lambda n, v: _url(n, v, DATABASE_SCHEMES)),
        broker_url=get("BRIDGE_BROKER_URL", lambda n, v: _url(n, v, BROKER_SCHEMES)),
        poll_interval=get("BRIDGE_POLL_INTERVAL", _positive_float),
        router=router,
        control_queue=control_queue,
        max_inflight=get("BRIDGE_MAX_INFLIGHT", _max_inflight),
        dispatch_lease=get("BRIDGE_DISPATCH_LEASE", _positive_int),
        default_lease=get("BRIDGE_DEFAULT_LEASE", _positive_int),
        retry_base=get("BRIDGE_RETRY_BASE", _positive_int),
        retry_max=get("BRIDGE_RETRY_MAX", _positive_int),
        retry_jitter=get("BRIDGE_RETRY_JITTER", _fraction),
        report_attempts=get("BRIDGE_REPORT_ATTEMPTS", _positive_int),
        handlers_include=_globs(get("BRIDGE_HANDLERS_INCLUDE")),
        handlers_exclude=_globs(get("BRIDGE_HANDLERS_EXCLUDE")),
        owner_prefix=prefix,
        inline_data_max=get("BRIDGE_INLINE_DATA_MAX", _positive_int),
        task_events=get("BRIDGE_TASK_EVENTS", _boolean),
        metrics_port=_port("BRIDGE_METRICS_PORT", metrics_port) if metrics_port else None,
        metrics_address=get("BRIDGE_METRICS_ADDRESS"),
        conduit=_conduit(env, get),
    )
    unknown_queues = sorted(set(settings.max_inflight.per_queue) - set(router.queues))
    if unknown_queues:
        raise ConfigError(
            "BRIDGE_MAX_INFLIGHT",
            f"no route leads to queue {unknown_queues[0]!r}; queues: {', '.join(router.queues)}",
        )
    if settings.retry_base > settings.retry_max:
        raise ConfigError("BRIDGE_RETRY_BASE", "must not be larger than BRIDGE_RETRY_MAX")
    if settings.dispatch_lease < 2 * settings.poll_interval:
        raise ConfigError("BRIDGE_DISPATCH_LEASE", "must be at least twice BRIDGE_POLL_INTERVAL")
    return settings


def explain() -> str:
    """The settings table (name, default, meaning) for the CLI and the README."""
    rows = ["| setting | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | `{s.default}` | {s.help} |" for s in SETTINGS]
    return "\n".join(rows)


@functools.cache
def current_settings() -> Settings:
    """This process's settings, read once from the environment."""
    return load_settings()

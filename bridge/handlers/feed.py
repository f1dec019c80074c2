"""Native ``FeedPublisherHTTPWorker``: delivers Phorge's feed.http-hooks from Python.

Phorge only supplies the story (through the extension's ``worker.feedstory``); the POST
itself is made here, so a slow or dead hook endpoint holds a Celery slot instead of a PHP
request. The body is byte-for-byte what PHP's ``http_build_query`` would send, so hook
receivers cannot tell the difference.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any, ClassVar
from urllib.parse import urlsplit

import requests

from bridge.conduit import ConduitClient, ConduitError
from bridge.handlers.base import Handler, PermanentFailure, TaskContext, TemporaryFailure
from bridge.handlers.conduit_proxy import conduit_failure

logger = logging.getLogger(__name__)

TASK_CLASS = "FeedPublisherHTTPWorker"
FEED_STORY_METHOD = "worker.feedstory"
HOOK_TIMEOUT = 30.0  # FeedPublisherHTTPWorker: setTimeout(30)
MAX_CLIENT_ERROR_ATTEMPTS = 3
MAX_RETRY_WAIT = 3600
# PHP's default "precision" ini setting, which http_build_query() uses for floats.
PHP_PRECISION = 14
USER_AGENT = "phorge-bridge (FeedPublisherHTTPWorker)"

# PHP's urlencode() (RFC 1738 flavour) leaves only these bytes alone and turns a space
# into "+"; everything else, "~" included, becomes an upper-case %XX.
_URLENCODE_TABLE = [
    chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "-_.") else f"%{b:02X}"
    for b in range(256)
]
_URLENCODE_TABLE[0x20] = "+"


def php_urlencode(value: str | bytes) -> str:
    """PHP's ``urlencode()`` of a UTF-8 string."""
    data = value.encode("utf-8") if isinstance(value, str) else value
    return "".join(_URLENCODE_TABLE[b] for b in data)


def php_float_to_string(value: float, precision: int = PHP_PRECISION) -> str:
    """A float as PHP's ``%.*G`` (php_gcvt) writes it, e.g. ``1.0E+25``, ``0.1``, ``-0``.

    ``precision`` is PHP's ``precision`` ini setting (14 by default; -1 = shortest).
    """
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    if precision == 0 or precision < -1:
        raise ValueError(f"unsupported PHP precision {precision}")
    negative = math.copysign(1.0, value) < 0
    magnitude = abs(value)
    if magnitude == 0:
        digits, decpt = "0", 1
    else:
        # Mode 2 of zend_dtoa: correctly rounded to `precision` significant digits;
        # mode 0 (precision -1): the shortest digits that read back as the same double.
        text = repr(magnitude) if precision == -1 else f"{magnitude:.{precision - 1}e}"
        _sign, digit_tuple, exponent = Decimal(text).as_tuple()
        digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
        decpt = len(digit_tuple) + int(exponent)
    ndigit = 17 if precision == -1 else precision
    if (decpt < -3) if decpt < 0 else (decpt > ndigit):
        exponent_value = decpt - 1
        mantissa = digits[0] + "." + (digits[1:] or "0")
        text = f"{mantissa}E{'-' if exponent_value < 0 else '+'}{abs(exponent_value)}"
    elif decpt < 0:
        text = "0." + "0" * -decpt + digits
    else:
        whole = digits[:decpt].ljust(decpt, "0") or "0"
        fraction = digits[decpt:]
        text = f"{whole}.{fraction}" if fraction else whole
    return "-" + text if negative else text


def _php_scalar(value: Any, precision: int) -> str | None:
    """A leaf value as http_build_query writes it; None means "left out" (PHP null)."""
    if value is None:
        return None
    if value is True:
        return "1"
    if value is False:
        return "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return php_float_to_string(value, precision)
    if isinstance(value, str | bytes):
        return value if isinstance(value, str) else value.decode("utf-8")
    raise TypeError(f"http_build_query: cannot encode {type(value).__name__}")


def _items(value: Mapping[Any, Any] | list[Any] | tuple[Any, ...]) -> Iterable[tuple[Any, Any]]:
    # A JSON array is a PHP list: its keys are the indexes.
    return value.items() if isinstance(value, Mapping) else enumerate(value)


def _key(key: Any) -> str:
    if key is True or key is False:
        return "1" if key else "0"
    return str(key)


def _append(parts: list[str], prefix: str, value: Any, precision: int) -> None:
    if isinstance(value, Mapping | list | tuple):
        for key, child in _items(value):
            _append(parts, f"{prefix}%5B{php_urlencode(_key(key))}%5D", child, precision)
        return
    text = _php_scalar(value, precision)
    if text is not None:
        parts.append(f"{prefix}={php_urlencode(text)}")


def http_build_query(data: Mapping[Any, Any] | list[Any], *, precision: int = PHP_PRECISION) -> str:
    """PHP's ``http_build_query($data, '', '&')`` (RFC 1738) for JSON-shaped data.

    Nested arrays become ``key[sub]=...`` with the brackets encoded (``%5B``/``%5D``), true
    and false become 1 and 0, null and empty arrays are left out.
    """
    parts: list[str] = []
    for key, value in _items(data):
        _append(parts, php_urlencode(_key(key)), value, precision)
    return "&".join(parts)


def redact_uri(uri: str) -> str:
    """A hook URI fit for logs: no user/password, query replaced (hooks carry secrets there)."""
    try:
        parts = urlsplit(uri)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(unparseable URI)"
    query = "?[redacted]" if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{query}"


def retry_wait(attempt: int) -> int:
    """Phorge's wait for this worker (attempt x 60 s), capped at an hour."""
    return min(max(attempt, 1) * 60, MAX_RETRY_WAIT)


def _retry_after(response: requests.Response) -> int | None:
    value = response.headers.get("Retry-After", "").strip()
    return int(value) if value.isdigit() else None


def _story_key(data: Any) -> str:
    key = data.get("key") if isinstance(data, dict) else None
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return str(key)
    if isinstance(key, str) and key.isdigit():
        return key
    raise PermanentFailure(f"task data has no usable feed story key: {key!r}")


class FeedPublisherHTTPHandler(Handler):
    """Delivers one feed story to one ``feed.http-hooks`` URI, as Phorge's worker would."""

    task_classes: ClassVar[tuple[str, ...]] = (TASK_CLASS,)

    def __init__(
        self,
        client: ConduitClient,
        *,
        session: requests.Session | None = None,
        timeout: float = HOOK_TIMEOUT,
        max_client_error_attempts: int = MAX_CLIENT_ERROR_ATTEMPTS,
        precision: int = PHP_PRECISION,
    ) -> None:
        self.client = client
        self.session = session if session is not None else requests.Session()
        self.timeout = timeout
        self.max_client_error_attempts = max_client_error_attempts
        self.precision = precision

    def wait_before_retry(self, task: TaskContext) -> int | None:
        return retry_wait(task.failureCount + 1)

    def fetch_story(self, task: TaskContext, key: str) -> dict[str, Any]:
        try:
            info = self.client.call(FEED_STORY_METHOD, {"key": key})
        except ConduitError as exc:
            raise conduit_failure(exc, task, self.client) from None
        if not isinstance(info, dict):
            raise TemporaryFailure(f"{FEED_STORY_METHOD} returned {type(info).__name__}")
        return info

    def run(self, task: TaskContext) -> None:
        key = _story_key(task.data)
        info = self.fetch_story(task, key)

        # The same checks, in the same order, as FeedPublisherHTTPWorker::doWork().
        if info.get("silent"):
            logger.info("task %s: phabricator.silent is on; feed hook not sent", task.id)
            return
        story = info.get("story")
        if not isinstance(story, dict):
            raise PermanentFailure(
                f'Feed story (with key "{key}") does not exist or could not be loaded.'
            )
        uri = task.data.get("uri")
        allowed = info.get("hookURIs") or []
        if not isinstance(uri, str) or uri not in allowed:
            shown = redact_uri(uri) if isinstance(uri, str) else repr(uri)
            raise PermanentFailure(f"hook URI {shown} is not listed in feed.http-hooks")
        if urlsplit(uri).scheme.lower() not in {"http", "https"}:
            raise PermanentFailure(f"hook URI {redact_uri(uri)} is not http(s)")

        fields = {
            name: story.get(name)
            for name in (
                "storyID",
                "storyType",
                "storyData",
                "storyAuthorPHID",
                "storyText",
                "epoch",
            )
        }
        body = http_build_query(fields, precision=self.precision)
        self.deliver(task, uri, body)

    def deliver(self, task: TaskContext, uri: str, body: str) -> None:
        """POST the body once and classify the answer; raises unless it is a 2xx."""
        attempt = task.failureCount + 1
        shown = redact_uri(uri)
        wait = retry_wait(attempt)
        try:
            response = self.session.post(
                uri,
                data=body.encode("ascii"),
                headers={
                    "Content-Type": "application/x-www-form-urlencoded",
                    "User-Agent": USER_AGENT,
                },
                timeout=(self.timeout, self.timeout),
                allow_redirects=False,
                stream=True,
            )
        except requests.RequestException as exc:
            kind = "timed out" if isinstance(exc, requests.Timeout) else "failed"
            logger.warning(
                "feed hook POST %s %s (task %s, attempt %s): %s",
                shown,
                kind,
                task.id,
                attempt,
                type(exc).__name__,
            )
            raise TemporaryFailure(
                f"feed hook POST {shown} {kind}: {type(exc).__name__}", wait=wait
            ) from None
        try:
            status = response.status_code
            location = response.headers.get("Location")
            retry_after = _retry_after(response)
        finally:
            # Only the status matters; do not download whatever the endpoint sends.
            response.close()

        logger.info(
            "feed hook POST %s -> HTTP %s (task %s, attempt %s)", shown, status, task.id, attempt
        )
        if 200 <= status < 300:
            return
        if status >= 500 or status == 429:
            if retry_after is not None:
                wait = min(max(wait, retry_after), MAX_RETRY_WAIT)
            raise TemporaryFailure(f"feed hook POST {shown}: HTTP {status}", wait=wait)
        # Redirects (not followed, as the body would be lost or re-sent elsewhere) and the
        # other 4xx: the endpoint rejects this request, but give it a few chances in case
        # the receiver is being redeployed.
        detail = f"HTTP {status}" + (f" redirect to {redact_uri(location)}" if location else "")
        if attempt >= self.max_client_error_attempts:
            raise PermanentFailure(
                f"feed hook POST {shown}: {detail} (attempt {attempt}, giving up)"
            )
        raise TemporaryFailure(f"feed hook POST {shown}: {detail}", wait=wait)

"""Native ``FeedPublisherHTTPWorker``: delivers Phorge's feed.http-hooks from Python.

Phorge only supplies the story (through the extension's ``worker.feedstory``); the POST
itself is made here, so a slow or dead hook endpoint holds a Celery slot instead of a PHP
request. The body is byte-for-byte what PHP's ``http_build_query`` would send, and the
User-Agent the one PHP's ``HTTPSFuture`` sends (``Arcanist/1.0 cURL/<PHP's libcurl>``,
as ``worker.feedstory`` reports it). What still differs: ``requests`` sends
``Connection: keep-alive`` and no empty ``Expect:``, and the bridge adds the execution's
``traceparent`` header.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import requests

from bridge.errors import ConduitError
from bridge.handlers.api import Handler, PermanentFailure, TaskContext, TemporaryFailure
from bridge.phorge.php import PHP_PRECISION, http_build_query
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import conduit_failure, trace_headers

logger = logging.getLogger(__name__)

TASK_CLASS = "FeedPublisherHTTPWorker"
FEED_STORY_METHOD = "worker.feedstory"
HOOK_TIMEOUT = 30.0  # FeedPublisherHTTPWorker: setTimeout(30)
MAX_CLIENT_ERROR_ATTEMPTS = 3
MAX_RETRY_WAIT = 3600
# HTTPSFuture's default (BaseHTTPFuture::getDefaultUserAgent() and cURL's version), for an
# extension too old to say which libcurl PHP uses.
FALLBACK_USER_AGENT = "Arcanist/1.0"


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

    task_classes = (TASK_CLASS,)
    phorge_defaults = True

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
        return retry_wait(task.failure_count + 1)

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
        user_agent = info.get("userAgent")
        self.deliver(
            task, uri, body, user_agent if isinstance(user_agent, str) else FALLBACK_USER_AGENT
        )

    def deliver(self, task: TaskContext, uri: str, body: str, user_agent: str) -> None:
        """POST the body once and classify the answer; raises unless it is a 2xx."""
        attempt = task.failure_count + 1
        shown = redact_uri(uri)
        delay = retry_wait(attempt)
        try:
            response = self.session.post(
                uri,
                data=body.encode("ascii"),
                headers={
                    "Content-Type": "application/x-www-form-urlencoded",
                    "User-Agent": user_agent,
                    "Accept": "*/*",
                    "Accept-Encoding": "gzip",
                    **trace_headers(task),
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
                f"feed hook POST {shown} {kind}: {type(exc).__name__}", delay=delay
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
                delay = min(max(delay, retry_after), MAX_RETRY_WAIT)
            raise TemporaryFailure(f"feed hook POST {shown}: HTTP {status}", delay=delay)
        # Redirects (not followed, as the body would be lost or re-sent elsewhere) and the
        # other 4xx: the endpoint rejects this request, but give it a few chances in case
        # the receiver is being redeployed.
        detail = f"HTTP {status}" + (f" redirect to {redact_uri(location)}" if location else "")
        if attempt >= self.max_client_error_attempts:
            raise PermanentFailure(
                f"feed hook POST {shown}: {detail} (attempt {attempt}, giving up)"
            )
        raise TemporaryFailure(f"feed hook POST {shown}: {detail}", delay=delay)

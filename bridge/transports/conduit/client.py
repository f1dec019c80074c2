"""Phorge Conduit client.

Speaks the wire format of Phorge's own client (arcanist's ``ConduitClient``): a form POST
to ``{base}/api/{method}`` carrying ``params`` (JSON, with the API token under
``__conduit__``), ``output=json`` and the ``__conduit__`` hint that makes Phorge answer its
own error pages in plain text. Failures come back typed, so callers can tell "Phorge said
no" (:class:`ConduitError`), "fix the token" (:class:`ConduitAuthError`) and "could not
talk to Phorge" (:class:`ConduitTransportError`) apart. The token never reaches a log line
or an exception message: Phorge echoes a rejected token in its error text, so every text we
surface is scrubbed of it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests

from bridge.config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    ConduitSettings,
    validate_base_url,
    validate_token,
)
from bridge.errors import (
    ConduitAuthError,
    ConduitError,
    ConduitMethodNotFoundError,
    ConduitTimeoutError,
    ConduitTransportError,
)

logger = logging.getLogger(__name__)


# Error codes meaning "the caller's credentials are not good enough": Phorge's own
# (PhabricatorConduitAPIController, ConduitCall) plus the one our extension raises for an
# authenticated caller who is not an administrator.
AUTH_ERROR_CODES = frozenset(
    {"ERR-INVALID-AUTH", "ERR-INVALID-SESSION", "ERR-OAUTH-ACCESS", "ERR-BRIDGE-PERMISSION"}
)

_METHOD_RE = re.compile(r"\A[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)+\Z")
_JSON_SHIELD = b"for (;;);"
_EXCERPT_CHARS = 240
_REDACTED = "[token redacted]"


def _parse_timeout(name: str, value: float | str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return seconds


def _body_excerpt(body: bytes, scrub: Callable[[str], str]) -> str:
    """A short readable piece of a response body, for error messages (HTML reduced to text).

    Scrubbed before it is cut: a token straddling the cut would otherwise leak its start.
    """
    text = body[: 64 * 1024].decode("utf-8", errors="replace")
    text = re.sub(r"(?is)<(script|style)\b.*?</\1\s*>", " ", text)
    text = re.sub(r"(?s)<[^>]*>", " ", text)
    text = scrub(" ".join(text.split()))
    if len(text) > _EXCERPT_CHARS:
        text = text[: _EXCERPT_CHARS - 3] + "..."
    return text or "(empty body)"


class ConduitClient:
    """A Conduit API client bound to one Phorge install and one API token."""

    def __init__(
        self,
        base_url: str,
        token: str,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        verify_tls: bool = True,
        session: requests.Session | None = None,
        token_setting: str = "BRIDGE_CONDUIT_TOKEN",
    ) -> None:
        self.base_url = validate_base_url(base_url)
        self.token_setting = token_setting
        self._token = validate_token(token)
        self.connect_timeout = _parse_timeout("connect_timeout", connect_timeout)
        self.read_timeout = _parse_timeout("read_timeout", read_timeout)
        self.verify_tls = verify_tls
        self._session = session if session is not None else requests.Session()
        if not verify_tls:
            logger.warning("Conduit: TLS certificate verification is OFF for %s", self.base_url)
        host = urlsplit(self.base_url).hostname or ""
        if self.base_url.startswith("http://") and host not in {"localhost", "127.0.0.1", "::1"}:
            logger.warning(
                "Conduit: %s is plain http; the API token crosses the network unencrypted",
                self.base_url,
            )

    @classmethod
    def from_settings(
        cls, settings: ConduitSettings, session: requests.Session | None = None
    ) -> ConduitClient:
        return cls(
            settings.url,
            settings.token,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            verify_tls=settings.verify_tls,
            session=session,
            token_setting=settings.token_setting,
        )

    def __repr__(self) -> str:
        return f"ConduitClient({self.base_url!r})"

    def close(self) -> None:
        self._session.close()

    def endpoint(self, method: str) -> str:
        return f"{self.base_url}/api/{method}"

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, _REDACTED) if text else text

    def call(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        read_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Call ``method`` and return its ``result``; raise a :class:`ConduitError` otherwise.

        ``read_timeout`` overrides the client's for this call (a long proxied worker);
        ``headers`` are added to the request's (a ``traceparent``).
        """
        if not _METHOD_RE.match(method):
            raise ValueError(f"not a Conduit method name: {method!r}")
        payload = dict(params or {})
        if "__conduit__" in payload:
            raise ValueError("params must not contain '__conduit__'; the client sets it")
        payload["__conduit__"] = {"token": self._token}
        form = {
            "params": json.dumps(payload, separators=(",", ":")),
            "output": "json",
            # Phorge's hint that a Conduit client is asking: its error pages come back as
            # plain text instead of HTML (AphrontStandaloneHTMLResponse).
            "__conduit__": "1",
        }
        url = self.endpoint(method)
        timeout = (self.connect_timeout, read_timeout or self.read_timeout)
        started = time.monotonic()
        try:
            response = self._session.post(
                url,
                data=form,
                timeout=timeout,
                verify=self.verify_tls,
                # A redirect would either drop the POST body or re-send the token to
                # another location: report it instead.
                allow_redirects=False,
                headers={**(headers or {}), "Accept": "application/json"},
            )
        except requests.Timeout as exc:
            phase = "connecting to" if isinstance(exc, requests.ConnectTimeout) else "waiting for"
            limit = timeout[0] if isinstance(exc, requests.ConnectTimeout) else timeout[1]
            raise ConduitTimeoutError(
                method,
                f"Conduit {method}: timed out {phase} {url} (after {limit:g}s)",
                sent=not isinstance(exc, requests.ConnectTimeout),
            ) from None
        except requests.RequestException as exc:
            raise ConduitTransportError(
                method, self._scrub(f"Conduit {method}: {url} unreachable: {exc}")
            ) from None
        elapsed = time.monotonic() - started
        logger.debug("Conduit %s: HTTP %s in %.3fs", method, response.status_code, elapsed)
        return self._parse(method, url, response)

    def _parse(self, method: str, url: str, response: requests.Response) -> Any:
        status = response.status_code
        body = response.content
        if 300 <= status < 400:
            location = response.headers.get("Location", "?")
            raise ConduitTransportError(
                method,
                self._scrub(
                    f"Conduit {method}: HTTP {status} redirect from {url} to {location}; "
                    "point the bridge's Conduit URL at the final address"
                ),
                http_status=status,
            )
        if status >= 500:
            raise ConduitTransportError(
                method,
                f"Conduit {method}: HTTP {status} from {url}: {_body_excerpt(body, self._scrub)}",
                http_status=status,
            )
        stripped = body.lstrip()
        if stripped.startswith(_JSON_SHIELD):
            stripped = stripped[len(_JSON_SHIELD) :]
        try:
            envelope = json.loads(stripped)
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict) or "error_code" not in envelope:
            raise ConduitTransportError(
                method,
                self._scrub(
                    f"Conduit {method}: HTTP {status} from {url} is not a Conduit JSON "
                    f"response: {_body_excerpt(body, self._scrub)}"
                ),
                http_status=status,
            )
        error_code = envelope.get("error_code")
        if error_code is None:
            if status != 200:
                raise ConduitTransportError(
                    method,
                    f"Conduit {method}: HTTP {status} from {url} with a result envelope",
                    http_status=status,
                )
            return envelope.get("result")
        error_code = self._scrub(str(error_code))
        error_info = self._scrub(str(envelope.get("error_info") or ""))
        message = f"Conduit {method}: {error_code}: {error_info}".rstrip(": ")
        if error_code in AUTH_ERROR_CODES:
            error_class: type[ConduitError] = ConduitAuthError
        elif error_code == "ERR-CONDUIT-CALL" and f'"{method}" does not exist' in error_info:
            error_class = ConduitMethodNotFoundError
        else:
            error_class = ConduitError
        raise error_class(method, message, error_code=error_code, error_info=error_info)

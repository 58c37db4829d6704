"""Helpers shared by the async client, the worker's threads and their sync clients."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional
from urllib.parse import quote

import httpx

from ._errors import BatonConnectionError, BatonError, error_from_response, parse_retry_after

__version__ = "0.1.0"
USER_AGENT = f"baton-client-python/{__version__}"


def base_headers(token: Optional[str]) -> Dict[str, str]:
    """Headers every request carries: ``User-Agent`` and, with a token, ``Authorization``."""
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def seg(value: str) -> str:
    """One URL path segment, percent-encoded (``/`` included)."""
    return quote(value, safe="")


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8, refusing NaN and infinities (not JSON).

    Raises:
        TypeError / ValueError: a value that is not JSON-serializable.
    """
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


JSON_HEADERS = {"Content-Type": "application/json"}


def decode(response: httpx.Response) -> Any:
    """The JSON body of a successful answer.

    Raises:
        BatonError (a subclass by status): an answer with status >= 400, or a body that is not JSON.
    """
    if response.status_code >= 400:
        raise error_of(response)
    try:
        return response.json()
    except ValueError as exc:
        raise BatonError(
            response.status_code,
            "invalid_response",
            f"the server's answer is not JSON: {response.text[:200]!r}",
        ) from exc


def error_of(response: httpx.Response) -> BatonError:
    """The exception for an error answer (status >= 400)."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    return error_from_response(
        response.status_code,
        body,
        parse_retry_after(response.headers.get("Retry-After")),
        response.text if body is None else "",
    )


def connection_error(exc: httpx.HTTPError, what: str) -> BatonConnectionError:
    """Wrap a transport failure (no answer) as :class:`BatonConnectionError`."""
    err = BatonConnectionError(f"{what}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err

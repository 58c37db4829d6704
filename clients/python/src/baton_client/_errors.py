"""Exceptions raised by the client and used by worker handlers."""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = [
    "BatonError",
    "BadRequestError",
    "AuthError",
    "NotFoundError",
    "ConflictError",
    "LeaseLostError",
    "UnavailableError",
    "BatonConnectionError",
]


class BatonError(Exception):
    """An error answered by ``baton serve`` (or the failure to reach it).

    Attributes:
        status: the HTTP status code (``404``, ``409``, ``503``, …); ``None`` when no answer
            came at all (see :class:`BatonConnectionError`).
        code: the server's error code, the ``"error"`` field of its JSON body
            (``"unknown_queue"``, ``"not_found"``, ``"conflict"``, ``"lease_lost"``, …);
            ``"http_<status>"`` when the body was not Baton's JSON error shape, and
            ``"connection_error"`` for :class:`BatonConnectionError`.
        message: the server's ``"message"`` (what to fix), or a description.
        body: the parsed JSON body of the answer (a dict), ``None`` if there was none.
        retry_after: seconds from the ``Retry-After`` header (``503``), else ``None``.
    """

    def __init__(
        self,
        status: Optional[int],
        code: str,
        message: str,
        *,
        body: Optional[Dict[str, Any]] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.body = body
        self.retry_after = retry_after
        prefix = f"{status} {code}" if status is not None else code
        super().__init__(f"{prefix}: {message}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class BadRequestError(BatonError):
    """``400`` (and other refusals of the request itself: ``413``, ``415``): the request is wrong."""


class AuthError(BatonError):
    """``401`` (no or invalid bearer token) or ``403`` (the token may not do this)."""


class NotFoundError(BatonError):
    """``404``: an unknown queue (code ``unknown_queue``) or command (code ``not_found``)."""


class ConflictError(BatonError):
    """``409``: e.g. code ``conflict`` (the id was submitted with another type, params or queue)."""


class LeaseLostError(ConflictError):
    """``409 lease_lost``: a settlement with a lease that is no longer this worker's."""


class UnavailableError(BatonError):
    """``503``: the backend is unavailable or all live-reader slots are taken.

    ``retry_after`` holds the server's ``Retry-After`` in seconds.
    """


class BatonConnectionError(BatonError):
    """The request got no answer: connection refused or reset, DNS failure, timeout.

    ``status`` is ``None`` and ``code`` is ``"connection_error"``; the underlying ``httpx``
    exception is the ``__cause__``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(None, "connection_error", message)


def error_from_response(
    status: int, body: Any, retry_after: Optional[float], fallback_text: str = ""
) -> BatonError:
    """Build the exception for an error answer (``status`` ≥ 400)."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        code = body["error"]
        message = str(body.get("message", ""))
        parsed: Optional[Dict[str, Any]] = body
    else:
        code = f"http_{status}"
        message = fallback_text.strip()[:500] or f"HTTP {status}"
        parsed = body if isinstance(body, dict) else None
    cls: type = BatonError
    if status == 404:
        cls = NotFoundError
    elif status == 409:
        cls = LeaseLostError if code == "lease_lost" else ConflictError
    elif status in (401, 403):
        cls = AuthError
    elif status == 503:
        cls = UnavailableError
    elif status in (400, 413, 415, 431):
        cls = BadRequestError
    return cls(status, code, message, body=parsed, retry_after=retry_after)  # type: ignore[no-any-return]


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """``Retry-After`` in seconds (only the delta-seconds form; an HTTP date gives ``None``)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return max(0.0, seconds)


"""Progress and checkpoints of a job (docs/workers.md, "Progress and checkpoints"), checked and
turned into JSON text when the handler reports them.

The renewal that carries them is one request for every lease of the worker, and the server
refuses all of it (``400``, nothing renewed) for one malformed report: so a bad report must
never get that far. Each check raises ``TypeError`` (a wrong type) or ``ValueError`` (a value
out of range) naming what to fix. Internal.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional, Tuple

from ._outcomes import RawJSON
from ._state import Progress

#: Longest progress message the server keeps, bytes of UTF-8.
MAX_MESSAGE_BYTES = 1024
#: Longest ``details`` the server keeps, bytes of JSON text.
MAX_DETAILS_BYTES = 64 * 1024


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'…' if len(text) > 40 else ''}"


def encode_progress(fraction: Any, message: Any, what: str) -> str:
    """Checks a progress report; its JSON text (``{"fraction"?, "message"?}``)."""
    if fraction is None and message is None:
        raise TypeError(f"{what}: progress needs fraction (0 to 1) and/or message (a string)")
    out = {}
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"{what}: progress fraction must be a number from 0 to 1, not {_kind(fraction)}")
        try:
            value = float(fraction)
        except OverflowError:  # an int too large for a float
            raise ValueError(f"{what}: progress fraction must be a number from 0 to 1, not {_kind(fraction)}") from None
        if not math.isfinite(value) or value < 0.0 or value > 1.0:
            raise ValueError(f"{what}: progress fraction must be a finite number from 0 to 1, not {fraction!r}")
        out["fraction"] = value
    if message is not None:
        if not isinstance(message, str):
            raise TypeError(f"{what}: progress message must be a string, not {_kind(message)}")
        try:
            size = len(message.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(
                f"{what}: progress message is not valid Unicode (a lone surrogate): it has no UTF-8 form"
            ) from None
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"{what}: progress message is {size} bytes of UTF-8; at most {MAX_MESSAGE_BYTES} are kept")
        out["message"] = message
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def encode_progress_value(progress: Any, what: str) -> str:
    """``progress`` as :meth:`Job.report` takes it: a :class:`Progress` or a mapping with
    ``fraction`` and/or ``message``."""
    if isinstance(progress, Progress):
        return encode_progress(progress.fraction, progress.message, what)
    if not isinstance(progress, Mapping):
        raise TypeError(
            f"{what}: progress must be a Progress or a dict like {{'fraction': 0.5, 'message': '…'}}, not {_kind(progress)}"
        )
    unknown = [k for k in progress if k not in ("fraction", "message")]
    if unknown:
        raise TypeError(f"{what}: unknown progress field {unknown[0]!r} (progress has only fraction and message)")
    return encode_progress(progress.get("fraction"), progress.get("message"), what)


def encode_details(details: Any, what: str) -> str:
    """Checks a checkpoint; its JSON text (any JSON value but ``null``; a :class:`RawJSON` is
    kept byte for byte)."""
    if details is None:
        raise TypeError(f"{what}: details must be a JSON value other than None (the server takes null for no details)")
    if isinstance(details, RawJSON):
        text = details.text
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{what}: details: the RawJSON text is not valid JSON ({exc})") from None
        if parsed is None:
            raise TypeError(f"{what}: details must be a JSON value other than null (the server takes null for no details)")
    else:
        try:
            text = json.dumps(details, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except TypeError as exc:
            raise TypeError(f"{what}: details are not JSON-serializable: {exc}") from None
        except ValueError as exc:  # NaN, an infinity, a circular reference
            raise ValueError(f"{what}: details are not representable as JSON: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what}: details hold a string that is not valid Unicode (a lone surrogate)") from None
    if size > MAX_DETAILS_BYTES:
        raise ValueError(
            f"{what}: details are {size} bytes of JSON; at most {MAX_DETAILS_BYTES} are kept "
            "(keep a checkpoint small, or store it elsewhere and keep its address)"
        )
    return text


def encode_report(progress: Any, details: Any, what: str) -> Tuple[Optional[str], Optional[str]]:
    """Checks ``report(progress=..., details=...)`` (at least one, ``None`` meaning not given)."""
    if progress is None and details is None:
        raise TypeError(f"{what}: a report needs progress and/or details")
    return (
        encode_progress_value(progress, what) if progress is not None else None,
        encode_details(details, what) if details is not None else None,
    )

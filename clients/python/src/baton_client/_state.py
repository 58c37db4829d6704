"""The typed view of a command's state, and duration helpers."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Optional, Union

__all__ = ["CommandStatus", "CommandState", "OutputLink", "Progress", "Duration", "format_duration", "duration_seconds"]

#: A duration: seconds as a number (``1.5``), or a string in the server's syntax (``"1500ms"``,
#: ``"30s"``, ``"2m"``), passed through unchanged.
Duration = Union[int, float, str]


def format_duration(value: Duration) -> str:
    """The server's text for a duration: seconds (int/float) become whole milliseconds
    (``1.5`` → ``"1500ms"``, rounded up so a positive duration never becomes ``0ms``);
    strings pass through unchanged.

    Raises:
        ValueError: a negative, NaN or infinite number of seconds.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a duration is seconds (int or float) or a string like '30s', not {value!r}")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"a duration must be a finite number of seconds >= 0, not {value!r}")
    return f"{math.ceil(value * 1000)}ms"


class CommandStatus(str, enum.Enum):
    """A command's status. ``SUCCEEDED``, ``FAILED`` and ``CANCELLED`` are terminal.

    Members compare equal to their strings: ``CommandStatus.SUCCEEDED == "SUCCEEDED"``.
    """

    SUBMITTED = "SUBMITTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """Whether the status is final (``SUCCEEDED``, ``FAILED`` or ``CANCELLED``)."""
        return self in _TERMINAL

    def __str__(self) -> str:
        return self.value


_TERMINAL = frozenset({CommandStatus.SUCCEEDED, CommandStatus.FAILED, CommandStatus.CANCELLED})


def _parse_time(value: Any) -> Optional[datetime]:
    if not isinstance(value, str):
        return None
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _status(value: Any) -> Union[CommandStatus, str]:
    try:
        return CommandStatus(value)
    except ValueError:  # a status this SDK does not know yet: keep the text
        return str(value)


@dataclass(frozen=True)
class Progress:
    """How far a worker says it is with a command (the state's ``progress``), as its handler
    reported it with ``job.progress(...)``.

    Attributes:
        fraction: from 0.0 to 1.0, or ``None`` when only a message was reported.
        message: a short text (at most 1 KiB of UTF-8), or ``None``.
    """

    fraction: Optional[float] = None
    message: Optional[str] = None

    @classmethod
    def from_json(cls, data: Any) -> Optional["Progress"]:
        """The view of the state's ``progress`` object (``None`` for anything else)."""
        if not isinstance(data, dict):
            return None
        fraction = data.get("fraction")
        message = data.get("message")
        return cls(
            fraction=float(fraction) if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) else None,
            message=message if isinstance(message, str) else None,
        )


@dataclass(frozen=True)
class OutputLink:
    """The command's output stream (the state's ``output``), for a command submitted with
    ``output``: a durable stream its handler writes and that ends with the command.

    Attributes:
        stream: the stream's path (default ``commands/<id>``; a re-run writes ``<path>/run-<n>``).
        url: where to read it: ``/v1/stream/<stream>`` (relative to the server's URL).
        run: 1 for the submit, +1 per re-run.
        content_type: the stream's content type (default ``application/json``).
        silence_timeout_ms: no append nor keepalive for this long ends the stream
            ``producer_lost`` and the command ``FAILED``; ``None``: never.
    """

    stream: str
    url: str
    run: int
    content_type: str
    silence_timeout_ms: Optional[int] = None

    @classmethod
    def from_json(cls, data: Any) -> Optional["OutputLink"]:
        """The view of the state's ``output`` object (``None`` for anything else)."""
        if not isinstance(data, dict) or not isinstance(data.get("stream"), str):
            return None
        silence = data.get("silence_timeout_ms")
        return cls(
            stream=data["stream"],
            url=str(data.get("url", "")),
            run=int(data.get("run") or 1),
            content_type=str(data.get("content_type", "")),
            silence_timeout_ms=int(silence) if isinstance(silence, int) else None,
        )


@dataclass(frozen=True)
class CommandState:
    """A command's state as ``GET /v1/commands/{id}`` answers it.

    Attributes:
        id: the command's id.
        queue: the queue it was submitted to.
        type: the command type.
        params: the submitted ``params``, parsed from JSON (``None`` when none were given).
        status: a :class:`CommandStatus` (a plain string if the server sends one this SDK
            does not know).
        result: the handler's result, parsed from JSON (``None`` until ``SUCCEEDED``).
        error: the failure or last handler error message, else ``None``.
        attempts: ``execute`` calls that returned or errored.
        errors_count: consecutive handler errors.
        created_at / started_at / modified_at / completed_at: timezone-aware UTC datetimes
            (``None`` where the server sends ``null``).
        version: the state's version, incremented at each change.
        handed_off_to: the queue the command was handed off to, else ``None``.
        progress: the last :class:`Progress` a worker reported (``job.progress``), else
            ``None``; kept in the final state.
        details: the last checkpoint a worker reported (``job.checkpoint``), parsed from JSON,
            else ``None``; kept in the final state, and handed to the next delivery
            (``job.details``).
        output: the command's :class:`OutputLink` when it was submitted with ``output``, else
            ``None``.
        run_at: a scheduled command's due time (submitted with ``run_at`` or ``delay``), a
            timezone-aware UTC datetime, else ``None``.
        priority: the priority it was submitted with (0 when the state shows none).
        concurrency_key: the concurrency key it was submitted with, else ``None``.
        raw: the whole JSON object as parsed, including fields this SDK does not model.
        created: for :meth:`BatonClient.submit` only: ``True`` when the submit created the
            command (``202``), ``False`` when the same id, type and params were already
            submitted (``200``); ``None`` for states from anything else.
    """

    id: str
    queue: str
    type: str
    params: Any
    status: Union[CommandStatus, str]
    result: Any
    error: Optional[str]
    attempts: int
    errors_count: int
    created_at: Optional[datetime]
    started_at: Optional[datetime]
    modified_at: Optional[datetime]
    completed_at: Optional[datetime]
    version: int
    handed_off_to: Optional[str]
    raw: Dict[str, Any] = field(repr=False, compare=False)
    created: Optional[bool] = field(default=None, compare=False)
    progress: Optional[Progress] = None
    details: Any = None
    output: Optional[OutputLink] = None
    run_at: Optional[datetime] = None
    priority: int = 0
    concurrency_key: Optional[str] = None

    @property
    def terminal(self) -> bool:
        """Whether the command has ended (``SUCCEEDED``, ``FAILED`` or ``CANCELLED``)."""
        return isinstance(self.status, CommandStatus) and self.status.terminal

    @classmethod
    def from_json(cls, data: Dict[str, Any], *, created: Optional[bool] = None) -> "CommandState":
        """Build the view from the JSON object the server sent (kept as ``raw``).

        Raises:
            TypeError: ``data`` is not a JSON object.
        """
        if not isinstance(data, dict):
            raise TypeError(f"a command state is a JSON object, not {type(data).__name__}")
        return cls(
            id=str(data.get("id", "")),
            queue=str(data.get("queue", "")),
            type=str(data.get("type", "")),
            params=data.get("params"),
            status=_status(data.get("status")),
            result=data.get("result"),
            error=data.get("error"),
            attempts=int(data.get("attempts") or 0),
            errors_count=int(data.get("errors_count") or 0),
            created_at=_parse_time(data.get("created_at")),
            started_at=_parse_time(data.get("started_at")),
            modified_at=_parse_time(data.get("modified_at")),
            completed_at=_parse_time(data.get("completed_at")),
            version=int(data.get("version") or 0),
            handed_off_to=data.get("handed_off_to"),
            raw=data,
            created=created,
            progress=Progress.from_json(data.get("progress")),
            details=data.get("details"),
            output=OutputLink.from_json(data.get("output")),
            run_at=_parse_time(data.get("run_at")),
            priority=int(data.get("priority") or 0),
            concurrency_key=data.get("concurrency_key") if isinstance(data.get("concurrency_key"), str) else None,
        )


_UNITS = {
    "ms": 0.001, "msec": 0.001, "millis": 0.001,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}


def duration_seconds(value: Duration) -> float:
    """A duration in seconds: numbers are seconds already; strings like ``"30s"``, ``"500ms"``,
    ``"1h 30m"`` are parsed (units ``ms``, ``s``, ``m``, ``h``, ``d``).

    Raises:
        ValueError: a string that is not such a duration, or a negative or non-finite number.
    """
    if not isinstance(value, str):
        format_duration(value)  # validates
        return float(value)
    text = value.strip()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != re.sub(r"\s+", "", text):
        raise ValueError(f"{value!r} is not a duration like '30s', '500ms' or '2m'")
    total = 0.0
    for number, unit in parts:
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise ValueError(f"{value!r} is not a duration like '30s', '500ms' or '2m' (unknown unit {unit!r})")
        total += float(number) * factor
    return total

"""What a handler returns or raises to choose a command's outcome."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Optional

from ._state import Duration, format_duration

__all__ = ["Failed", "Running", "HandOff", "Release", "RawJSON", "CancelReason", "JobCancelled"]


class Failed(Exception):
    """Raise (or return) ``Failed("message")`` from a handler to end the command ``FAILED``
    with that message as its ``error``. Unlike any other exception it is not retried."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = str(message)


@dataclass(frozen=True)
class Running:
    """Return ``Running(next_check=…)`` from a handler: the work goes on elsewhere; the command
    becomes ``RUNNING`` and is handed out again as a ``check_status`` call after ``next_check``
    (seconds, or a string like ``"10s"``; ``None``: the queue's ``check_status_interval``)."""

    next_check: Optional[Duration] = None

    def __post_init__(self) -> None:
        if self.next_check is not None:
            format_duration(self.next_check)  # raises on a negative or non-finite number


@dataclass(frozen=True)
class HandOff:
    """Return ``HandOff("other-queue")`` from a handler: the command becomes ``RUNNING`` on that
    queue, whose workers get ``check_status`` calls for it."""

    queue: str


@dataclass(frozen=True)
class Release:
    """Return ``Release()`` from a handler: hand the command back unrun. Another worker gets it
    after the queue's claim timeout (a delivery, not an attempt)."""


@dataclass(frozen=True)
class RawJSON:
    """A handler result given as JSON text, stored byte for byte (e.g. numbers beyond a
    float's precision). ``RawJSON('{"n": 18446744073709551615}')``.

    Raises:
        ValueError: ``text`` is not valid JSON.
    """

    text: str

    def __post_init__(self) -> None:
        json.loads(self.text)


class CancelReason(str, enum.Enum):
    """Why a job's cancellation signal fired (``Job.cancel_reason``)."""

    #: The command was cancelled (``POST /v1/commands/{id}/cancel``) or ended otherwise: the
    #: renewal said ``cancelled: true``. The worker settles ``cancelled`` when the handler ends;
    #: whatever the handler returns is not stored.
    CANCELLED = "cancelled"
    #: The lease is no longer this worker's: the server said so, a renewal answering ``lost``
    #: or ``gone``. The command may already run elsewhere; the worker never settles it. Only
    #: the server's answer fires it: renewals that fail (no answer, a timeout, ``5xx``), even
    #: past the claim timeout, leave the handler running and are retried (the server tells on
    #: the first renewal that gets through whether the lease is still held).
    LEASE_LOST = "lease_lost"
    #: The worker is stopping and the shutdown grace period ended. The lease is released
    #: (another worker runs the command after the claim timeout) unless the handler still
    #: returns an outcome quickly (within ``cancel_grace``), which is then settled.
    SHUTDOWN = "shutdown"

    def __str__(self) -> str:
        return self.value


class JobCancelled(Exception):
    """Raised by :meth:`Job.raise_if_cancelled` once the job's cancellation signal fired;
    ``reason`` is the :class:`CancelReason`."""

    def __init__(self, reason: CancelReason) -> None:
        super().__init__(f"job cancelled ({reason.value})")
        self.reason = reason

"""Python SDK of Baton: an asyncio client of the command API and a remote worker.

- :class:`BatonClient`: submit (one or many), get, wait for and cancel commands.
- :class:`Worker`: claim a queue's commands over HTTP and run a handler for each, with
  leases renewed from a process of its own (see the README).
"""

from ._client import MAX_BATCH, MAX_WAIT, BatonClient, SubmitItem
from ._errors import (
    AuthError,
    BadRequestError,
    BatonConnectionError,
    BatonError,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    UnavailableError,
)
from ._http import __version__
from ._job import Job, JobOutput, Lease
from ._outcomes import CancelReason, Failed, HandOff, JobCancelled, RawJSON, Release, Running
from ._state import CommandState, CommandStatus, Duration, OutputLink, Progress, duration_seconds, format_duration
from ._worker import Handler, Worker, default_worker_name

__all__ = [
    "AuthError",
    "BadRequestError",
    "BatonClient",
    "BatonConnectionError",
    "BatonError",
    "CancelReason",
    "CommandState",
    "CommandStatus",
    "ConflictError",
    "Duration",
    "Failed",
    "HandOff",
    "Handler",
    "Job",
    "JobCancelled",
    "JobOutput",
    "Lease",
    "LeaseLostError",
    "MAX_BATCH",
    "MAX_WAIT",
    "NotFoundError",
    "OutputLink",
    "Progress",
    "RawJSON",
    "Release",
    "Running",
    "SubmitItem",
    "UnavailableError",
    "Worker",
    "__version__",
    "default_worker_name",
    "duration_seconds",
    "format_duration",
]

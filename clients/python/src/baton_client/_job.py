"""The job object a worker hands to its handler."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Dict, Optional

from ._outcomes import CancelReason, JobCancelled
from ._report import encode_details, encode_progress, encode_report
from ._state import CommandState

__all__ = ["Job", "JobOutput", "Lease"]


class JobOutput:
    """A claimed command's output stream, opened for this delivery (the lease's ``output``).

    Append to it with the Durable Streams protocol: ``POST <server><url>`` with the stream's
    ``content_type`` and the producer headers of :meth:`headers` (``Producer-Seq`` 0, 1, 2… for
    the appends of this delivery: idempotent, a retried append is not written twice). The epoch
    is newer than any earlier delivery's, which fences a worker that lost the command. Do not
    close it: it ends with the command when the job's outcome is settled.

    Attributes:
        stream: the stream's path.
        url: its path on the server, ``/v1/stream/<stream>``.
        content_type: the stream's content type.
        producer_id: ``"command"``, or ``None`` when the stream had already ended at the claim.
        producer_epoch: this delivery's producer epoch, or ``None`` as ``producer_id``.
    """

    __slots__ = ("stream", "url", "content_type", "producer_id", "producer_epoch")

    def __init__(self, data: Dict[str, Any]) -> None:
        self.stream: str = str(data["stream"])
        self.url: str = str(data["url"])
        self.content_type: str = str(data.get("content_type", "application/json"))
        pid = data.get("producer_id")
        epoch = data.get("producer_epoch")
        self.producer_id: Optional[str] = pid if isinstance(pid, str) else None
        self.producer_epoch: Optional[int] = epoch if isinstance(epoch, int) else None

    def headers(self, seq: int) -> Dict[str, str]:
        """The headers of this delivery's append number ``seq`` (from 0): ``Content-Type`` and
        the producer's ``Producer-Id``, ``Producer-Epoch`` and ``Producer-Seq``.

        Raises:
            RuntimeError: the stream had ended at the claim (no producer epoch).
        """
        if self.producer_id is None or self.producer_epoch is None:
            raise RuntimeError(f"the output stream {self.stream} had already ended when the command was claimed")
        return {
            "content-type": self.content_type,
            "producer-id": self.producer_id,
            "producer-epoch": str(self.producer_epoch),
            "producer-seq": str(seq),
        }

    def __repr__(self) -> str:
        return f"JobOutput(stream={self.stream!r}, producer_epoch={self.producer_epoch!r})"


class Lease:
    """One claimed delivery as ``POST …/claim`` answers it (an element of ``"leases"``).

    Attributes:
        token: the opaque lease token (``"lease"``).
        call: ``"execute"`` or ``"check_status"``.
        command: the command's state.
        deliveries: deliveries of the command's message, this one included.
        lease_timeout: the queue's claim timeout, in seconds (``lease_timeout_ms / 1000``).
        output: the command's output stream opened for this delivery (:class:`JobOutput`), or
            ``None`` when it has none.
        raw: the JSON object as parsed.
    """

    __slots__ = ("token", "call", "command", "deliveries", "lease_timeout", "output", "raw")

    def __init__(self, data: Dict[str, Any]) -> None:
        self.raw = data
        self.token: str = data["lease"]
        self.call: str = data["call"]
        self.command = CommandState.from_json(data["command"])
        self.deliveries: int = int(data.get("deliveries") or 1)
        self.lease_timeout: float = float(data["lease_timeout_ms"]) / 1000.0
        output = data.get("output")
        self.output: Optional[JobOutput] = JobOutput(output) if isinstance(output, dict) else None


class Job:
    """What a handler gets: one delivery of one command.

    Attributes:
        call: ``"execute"`` (the command is ``SUBMITTED``: run it) or ``"check_status"`` (it is
            ``RUNNING`` after an earlier ``Running`` or ``HandOff``: check on the work).
        command: the command's state when it was claimed (a :class:`CommandState`).
        deliveries: how many times the command's message was delivered, this one included
            (``2`` or more: an earlier worker went silent or released it).
        queue: the queue it was claimed from.
        worker: the claiming worker's name.
        lease: the opaque lease token.
        lease_timeout: the queue's claim timeout in seconds; the worker renews the lease every
            third of it, from a process of its own.
        claimed_at: ``time.monotonic()`` when the claim request was sent.
        output: the command's output stream, opened for this delivery (:class:`JobOutput`:
            append to it with its producer headers), or ``None`` when the command has none.

    Cancellation: :attr:`cancelled` is a ``threading.Event`` (``is_set()``, ``wait(timeout)``)
    for plain ``def`` handlers; ``await job.wait_cancelled()`` for ``async def`` ones (whose task
    is also cancelled: ``asyncio.CancelledError`` is raised at their next ``await``).
    :attr:`cancel_reason` says why (:class:`CancelReason`).

    Progress and checkpoints: :meth:`progress`, :meth:`checkpoint` and :meth:`report` go with
    the lease's next renewal (within ``lease_timeout / 3``); :attr:`details` is the checkpoint
    an earlier delivery left, to resume from.
    """

    def __init__(self, lease: Lease, queue: str, worker: str, claimed_at: float) -> None:
        self._lease = lease
        self.call: str = lease.call
        self.command: CommandState = lease.command
        self.deliveries: int = lease.deliveries
        self.queue = queue
        self.worker = worker
        self.lease: str = lease.token
        self.lease_timeout: float = lease.lease_timeout
        self.output: Optional[JobOutput] = lease.output
        self.claimed_at = claimed_at
        self._cancelled = threading.Event()
        self._reason: Optional[CancelReason] = None
        self._lock = threading.Lock()
        # Set by the worker, in its event loop's thread:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._async_event: Optional[asyncio.Event] = None
        self._task: Optional["asyncio.Future[Any]"] = None
        self._abandon: Optional["asyncio.Future[None]"] = None
        self._wake: Optional[asyncio.Event] = None  # the worker's wait for _confirmed or a signal
        # Bookkeeping shared with the renewals' reader thread (under _lock):
        self._lost = False  # the server said the lease is not ours any more: never settle
        self._settling = False
        self._renewal_end: Optional[str] = None  # "lost" or "gone" said by a renewal while settling
        # Cleared for a lease that reached the worker late (it may have lapsed): set when a
        # renewal says it is held. The handler does not start before.
        self._confirmed = threading.Event()
        self._confirmed.set()
        # Progress and checkpoints: set by the worker before the handler starts. _report_to
        # passes a checked report (JSON texts) to the renewal process; _ended (under _lock) once
        # the handler ended: reports do nothing from then on.
        self._report_to: Optional[Callable[["Job", Optional[str], Optional[str]], None]] = None
        self._reported = False
        self._ended = False

    @property
    def id(self) -> str:
        """The command's id."""
        return self.command.id

    @property
    def type(self) -> str:
        """The command type."""
        return self.command.type

    @property
    def params(self) -> Any:
        """The command's params, parsed from JSON (``None`` when it has none)."""
        return self.command.params

    @property
    def attempts(self) -> int:
        """``execute`` calls of the command that returned or errored before this one."""
        return self.command.attempts

    @property
    def details(self) -> Any:
        """The last checkpoint reported for this command before this delivery (by an earlier
        delivery whose worker died or went silent, released it, raised an error that is retried,
        or returned :class:`Running`), parsed from JSON: the claim's ``command.details``.
        ``None`` when no checkpoint was ever reported. It stays what this delivery started from
        (a :meth:`checkpoint` of this handler does not change it)."""
        return self.command.details

    def progress(self, fraction: Optional[float] = None, message: Optional[str] = None) -> None:
        """Reports how far the handler is: written into the command's state (``progress``) with
        the lease's next renewal, at most ``lease_timeout / 3`` from now. Only the latest
        progress goes out (a newer one replaces an unsent one whole). Thread-safe; does not block.

        Args:
            fraction: from 0 to 1.
            message: a short text, at most 1024 bytes of UTF-8.

        Raises:
            TypeError: neither given, or a wrong type.
            ValueError: ``fraction`` not finite or outside 0–1; ``message`` too long or not
                valid Unicode.
        """
        self._report(encode_progress(fraction, message, "job.progress"), None)

    def checkpoint(self, details: Any) -> None:
        """Records a checkpoint: ``details`` is written into the command's state (``details``)
        with the lease's next renewal and handed to the next delivery of the command as
        :attr:`details` (after a crash, a takeover, a release, a retried error or a
        ``check_status`` call). Serialized at the call (changing the object later changes
        nothing); only the latest unsent checkpoint goes out. Thread-safe; does not block.

        Args:
            details: any JSON-serializable value but ``None`` (or :class:`RawJSON`, kept byte
                for byte), at most 64 KiB of JSON.

        Raises:
            TypeError: ``None``, or not JSON-serializable.
            ValueError: NaN or an infinity, a circular reference, over 64 KiB, a lone surrogate.
        """
        self._report(None, encode_details(details, "job.checkpoint"))

    def report(self, progress: Any = None, details: Any = None) -> None:
        """:meth:`progress` and :meth:`checkpoint` in one: ``progress`` is a :class:`Progress`
        or a dict with ``fraction`` and/or ``message``; ``details`` any JSON value but ``None``.
        At least one of them. Raises as those two do."""
        encoded_progress, encoded_details = encode_report(progress, details, "job.report")
        self._report(encoded_progress, encoded_details)

    def _report(self, progress: Optional[str], details: Optional[str]) -> None:
        with self._lock:
            if self._ended or self._lost or self._report_to is None:
                return  # the lease is over (or the handler ended): nothing can be written
            self._reported = True
            # Under the lock: a report and the end of the handler (then a flush) are ordered.
            self._report_to(self, progress, details)

    @property
    def cancelled(self) -> threading.Event:
        """The cancellation signal, a ``threading.Event``: ``job.cancelled.is_set()``,
        ``job.cancelled.wait(timeout)``. Do not set or clear it."""
        return self._cancelled

    @property
    def cancel_reason(self) -> Optional[CancelReason]:
        """Why the signal fired, ``None`` while it has not."""
        return self._reason

    def raise_if_cancelled(self) -> None:
        """Raise :class:`JobCancelled` if the cancellation signal fired (a handy check point in
        a plain ``def`` handler's loop)."""
        reason = self._reason
        if reason is not None:
            raise JobCancelled(reason)

    async def wait_cancelled(self) -> CancelReason:
        """Wait (in the worker's event loop) until the cancellation signal fires; returns why."""
        if self._async_event is None:
            self._async_event = asyncio.Event()
            if self._cancelled.is_set():
                self._async_event.set()
        await self._async_event.wait()
        assert self._reason is not None
        return self._reason

    # --- internal: signalled from any thread ---

    def _signal(self, reason: CancelReason) -> bool:
        """Fire the cancellation signal (once; later reasons are ignored, except that a lost
        lease is always recorded as lost). Thread-safe. Returns whether it fired now."""
        with self._lock:
            if reason is CancelReason.LEASE_LOST:
                self._lost = True
            if self._reason is not None:
                return False
            self._reason = reason
        self._cancelled.set()
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._on_signal_in_loop)
            except RuntimeError:  # the loop is closed: nothing left to wake
                pass
        return True

    def _confirm(self) -> None:
        """A renewal said the lease is held (thread-safe)."""
        if self._confirmed.is_set():
            return
        self._confirmed.set()
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake_in_loop)
            except RuntimeError:
                pass

    def _wake_in_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _on_signal_in_loop(self) -> None:
        self._wake_in_loop()
        if self._async_event is not None:
            self._async_event.set()
        task = self._task
        if task is not None and not task.done():
            task.cancel()

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, type={self.type!r}, call={self.call!r}, deliveries={self.deliveries})"

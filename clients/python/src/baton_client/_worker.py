"""The asyncio worker: claims commands over HTTP, runs handlers, renews leases, settles."""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Tuple, Union

import httpx

from . import _renewal
from ._errors import BatonError
from ._http import JSON_HEADERS, base_headers, decode, dumps, error_of, seg
from ._job import Job, Lease
from ._outcomes import CancelReason, Failed, HandOff, RawJSON, Release, Running
from ._state import Duration, duration_seconds, format_duration

__all__ = ["Worker", "Handler", "default_worker_name"]

log = logging.getLogger("baton_client.worker")

#: A handler: ``def handler(job) -> result`` (run in its own thread, so it may block) or
#: ``async def handler(job) -> result`` (run as a task in the worker's event loop).
Handler = Callable[[Job], Any]

_MAX_CLAIM = 100  # the server's limit of "max" in one claim
_MAX_SETTLE = 1000  # the server's limit of settlements in one request
_SETTLE_BATCH_BYTES = 256 * 1024  # a batch's body stays well under --max-command-body (1 MiB)
_SETTLE_THREADS = 1  # settle requests in flight at once (a second one measured slower: the GIL)
_CLAIM_LINGER = 0.02  # seconds a claim waits for a batch of free slots while jobs run
_SETTLE_ON_STOP = 5.0  # seconds a stopping worker keeps retrying settlements without an answer
_FLUSH_WAIT = 5.0  # seconds a settlement waits for the handler's last report to go out
_FLUSH_WAIT_ON_STOP = 1.0  # the same, while the worker stops


def default_worker_name() -> str:
    """``<host>-<pid>-<6 random hex digits>``, at most 128 bytes."""
    host = socket.gethostname() or "host"
    host = "".join(c for c in host if c.isprintable())[:100] or "host"
    return f"{host}-{os.getpid()}-{random.getrandbits(24):06x}"


def _is_async(handler: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


class _Backoff:
    """Exponential backoff with jitter: 0.1 s doubling up to ``cap``."""

    def __init__(self, cap: float = 5.0) -> None:
        self.cap = cap
        self.current = 0.0

    def next(self) -> float:
        self.current = min(self.cap, self.current * 2) if self.current else 0.1
        return self.current * random.uniform(0.75, 1.25)

    def reset(self) -> None:
        self.current = 0.0


class _Renewer:
    """Keeps the worker's leases: renews them from a process of its own (:mod:`._renewal`),
    every third of the lease timeout, all in one ``renew`` request.

    A separate process has its own GIL: a handler that holds the worker's GIL for a long time
    (one long C call, a C extension that does not release it), or blocks the event loop, does
    not delay a renewal. The worker tells the process which leases it holds (``add`` when
    claimed, ``remove`` when settled) through its stdin; the process writes back what the
    server answered about them, read here by a thread of ours. Only a definite answer ends a
    lease: ``lost`` or ``gone``; a failed request (no answer, a timeout, ``5xx``) leaves the
    leases held and is tried again soon. The process exits when the worker process dies (so a
    dead worker's leases lapse) and when :meth:`stop` closes its stdin; one that dies while
    the worker runs is replaced, and told every held lease again.
    """

    def __init__(self, worker: "Worker") -> None:
        self._worker = worker
        self._lock = threading.Lock()  # _held, _proc and writes to its stdin
        self._held: Dict[str, Job] = {}
        self._proc: Optional["subprocess.Popen[bytes]"] = None
        self._removed: List[str] = []  # by remove_soon, to send
        self._flushing: Dict[str, Callable[[], None]] = {}  # lease -> wakes its flush's waiter
        self._ready = threading.Event()
        self._stopping = False
        self._restarts = 0

    # --- the worker's calls ---

    def start(self, timeout: float = 30.0) -> None:
        """Starts the renewal process and waits until it runs (blocking).

        Raises:
            RuntimeError: it did not start.
        """
        try:
            with self._lock:
                proc = self._spawn_locked()
        except (OSError, RuntimeError) as exc:
            self._stopping = True
            raise RuntimeError(f"the worker's lease renewal process did not start: {exc}") from exc
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05) and proc.poll() is None and time.monotonic() < deadline:
            pass
        if not self._ready.is_set() or proc.poll() is not None:
            self.stop()
            raise RuntimeError(
                f"the worker's lease renewal process ({sys.executable} -c …) did not start "
                f"(exit code {proc.poll()}); its errors are on stderr"
            )

    def add(self, jobs: List[Job]) -> None:
        """Hold these leases (thread-safe). A lease whose claim took more than a third of its
        timeout to reach us (a long-poll that waited, or a starved claim thread) may have lapsed
        meanwhile: its job waits, before its handler starts, for a renewal saying it is held."""
        now = time.monotonic()
        items = []
        for job in jobs:
            age = now - job.claimed_at
            confirm = age >= job.lease_timeout / 3.0
            if confirm:
                job._confirmed.clear()
            items.append([job.lease, job.lease_timeout, age, confirm])
        with self._lock:
            for job in jobs:
                self._held[job.lease] = job
            self._send_locked({"add": items})

    def remove(self, job: Job) -> None:
        """Stop renewing this lease (thread-safe)."""
        with self._lock:
            if self._held.pop(job.lease, None) is not None:
                self._send_locked({"remove": [job.lease]})

    def remove_soon(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`remove`, from the worker's loop: the leases of the jobs that end in one turn
        of the loop are sent in one message (one write, not one per job)."""
        with self._lock:
            if self._held.pop(job.lease, None) is None:
                return
            self._removed.append(job.lease)
            if len(self._removed) > 1:
                return  # a flush is on its way
        loop.call_soon(self._flush_removed)

    def report(self, job: Job, progress: Optional[str], details: Optional[str]) -> None:
        """A handler's checked report (JSON texts, ``None`` for a part not given): the renewal
        process sends it with the lease's next renewal (thread-safe)."""
        with self._lock:
            if job.lease in self._held:
                self._send_locked({"report": [job.lease, progress, details]})

    async def flush(self, job: Job, timeout: float) -> None:
        """Has the renewal process send ``job``'s report not written yet (if any) now, with a
        renewal, and waits for that renewal (at most ``timeout`` seconds). From the worker's loop."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:
                pass

        with self._lock:
            if job.lease not in self._held or self._proc is None or self._stopping:
                return
            self._flushing[job.lease] = wake
            self._send_locked({"flush": job.lease})
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("command %s: its last progress/checkpoint report did not go out within %.1fs; settling",
                        job.id, timeout)
        finally:
            with self._lock:
                if self._flushing.get(job.lease) is wake:
                    del self._flushing[job.lease]

    def _flush_removed(self) -> None:
        with self._lock:
            removed, self._removed = self._removed, []
            if removed:
                self._send_locked({"remove": removed})

    def stop(self, timeout: float = 2.0) -> None:
        """Ends the renewal process (it renews nothing more) and waits for it (blocking)."""
        with self._lock:
            self._stopping = True
            proc = self._proc
            self._held.clear()
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # end of file: it exits at once
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # --- the process ---

    def _spawn_locked(self) -> "subprocess.Popen[bytes]":
        w = self._worker
        proc = subprocess.Popen(
            _renewal.spawn_args(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            # Out of the terminal's process group: a Ctrl-C is the worker's to handle.
            start_new_session=os.name == "posix",
        )
        self._proc = proc
        assert proc.stdin is not None
        try:
            url = f"{w.url}/v1/queues/{seg(w.queue)}/workers/{seg(w.name)}/renew"
            proc.stdin.write(_renewal.config(url, {**base_headers(w._token), **JSON_HEADERS}))
            proc.stdin.flush()
        except OSError:
            pass  # it died at once: the reader sees the end of its output
        threading.Thread(target=self._read, args=(proc,), name=f"baton-renewals-{w.name}", daemon=True).start()
        return proc

    def _send_locked(self, message: Dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or self._stopping:
            return
        try:
            proc.stdin.write(dumps(message) + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it died: the reader starts another, which is told every held lease

    def _read(self, proc: "subprocess.Popen[bytes]") -> None:
        """The reader thread of one renewal process: acts on its reports until it exits."""
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                try:
                    message = json.loads(line)
                    self._on_message(message)
                except Exception:  # pragma: no cover - a bug: keep reading
                    log.exception("internal error handling the renewal process's message %r", line[:200])
        except (OSError, ValueError):
            pass
        code = proc.wait()
        with self._lock:
            if self._stopping or proc is not self._proc or not self._ready.is_set():
                return  # (not started yet: start() fails)
        # It died while the worker runs: the leases are not renewed. Start another at once.
        self._restarts += 1
        log.error("the lease renewal process exited (code %s) while the worker runs: starting another", code)
        time.sleep(min(5.0, 0.1 * self._restarts))
        with self._lock:
            if self._stopping:
                return
            try:
                self._spawn_locked()
            except (OSError, RuntimeError) as exc:
                self._proc = None
                msg = f"starting the lease renewal process again failed ({exc}): the worker stops"
                log.error("%s", msg)
                self._worker._claimer_failed(BatonError(None, "internal", msg))
                return
            now = time.monotonic()
            # Renewed at once (age: a whole timeout), confirmed only where still awaited.
            items = [[j.lease, j.lease_timeout, max(now - j.claimed_at, j.lease_timeout), not j._confirmed.is_set()]
                     for j in self._held.values()]
            if items:
                self._send_locked({"add": items})

    def _on_message(self, message: Dict[str, Any]) -> None:
        if "leases" in message:
            for lease, state, cancelled in message["leases"]:
                self._on_lease(lease, state, cancelled)
        elif "flushed" in message:
            with self._lock:
                wake = self._flushing.pop(message["flushed"], None)
            if wake is not None:
                wake()
        elif "log" in message:
            level, text = message["log"]
            log.log(int(level), "%s", text)
        elif "ready" in message:
            self._ready.set()

    def _on_lease(self, lease: str, state: str, cancelled: bool) -> None:
        with self._lock:
            job = self._held.get(lease) if state == "held" else self._held.pop(lease, None)
        if job is None:  # settled meanwhile
            return
        if state == "held":
            if cancelled and job._signal(CancelReason.CANCELLED):
                log.info("command %s was cancelled: signalling its handler", job.id)
            job._confirm()
            return
        with job._lock:
            settling = job._settling
            job._renewal_end = state
        if not settling:
            log.warning(
                "lease of command %s is %s: another worker may run it; it will not be settled here", job.id, state
            )
            job._signal(CancelReason.LEASE_LOST)


class _Claimer(threading.Thread):
    """Claims commands for free slots, long-polling, in its own thread and event loop.

    Claimed leases are registered with the renewer here, before the worker's event loop sees
    them, so they hold even while that loop is blocked.
    """

    def __init__(self, worker: "Worker", wait: str, wait_seconds: float) -> None:
        super().__init__(name=f"baton-claim-{worker.name}", daemon=True)
        self._worker = worker
        self._url = f"{worker.url}/v1/queues/{seg(worker.queue)}/workers/{seg(worker.name)}/claim"
        self._release_url = f"{worker.url}/v1/queues/{seg(worker.queue)}/workers/{seg(worker.name)}/settle"
        self._headers = {**base_headers(worker._token), **JSON_HEADERS}
        self._wait = wait
        self._wait_seconds = wait_seconds
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional["asyncio.Task[None]"] = None
        self._wake: Optional[asyncio.Event] = None
        self._started = threading.Event()
        self._stopping = False
        self._waiting = False  # waiting for a free slot: wake() must signal

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except asyncio.CancelledError:  # stopped while closing its connections
            pass
        except Exception:  # pragma: no cover - a bug: make it visible and stop the worker
            log.exception("the claim loop failed")
            self._worker._claimer_failed(BatonError(None, "internal", "the claim loop failed"))
        finally:
            self._started.set()

    def wake(self) -> None:
        """Tell the claim loop that a slot is free (thread-safe; only when it waits for one)."""
        loop, event = self._loop, self._wake
        if self._waiting and loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def stop(self) -> None:
        """Stop claiming; an outstanding long-poll is abandoned (thread-safe)."""
        self._stopping = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.current_task()
        self._started.set()
        if self._stopping:
            return
        worker = self._worker
        batch = max(1, min(_MAX_CLAIM, worker.concurrency // 4))
        backoff = _Backoff()
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:
            try:
                while not self._stopping:
                    free = worker._free_slots()
                    if free <= 0:
                        self._wake.clear()
                        self._waiting = True
                        if worker._free_slots() <= 0:
                            await self._wake.wait()
                        self._waiting = False
                        continue
                    if free < batch and free < worker.concurrency:
                        # Jobs are running and few slots are free: wait a moment for more to
                        # free up, so that claims come in batches rather than one per job.
                        await asyncio.sleep(_CLAIM_LINGER)
                        free = worker._free_slots()
                    sent = time.monotonic()
                    try:
                        response = await client.post(
                            self._url,
                            content=dumps({"max": min(free, _MAX_CLAIM), "wait": self._wait}),
                            headers=self._headers,
                            timeout=self._wait_seconds + 30.0,
                        )
                    except httpx.HTTPError as exc:
                        delay = backoff.next()
                        log.warning("claim failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                        await asyncio.sleep(delay)
                        continue
                    if response.status_code >= 400:
                        err = error_of(response)
                        if response.status_code in (400, 401, 403, 404):
                            log.error("claim refused: %s; the worker stops", err)
                            worker._claimer_failed(err)
                            return
                        delay = err.retry_after if err.retry_after is not None else backoff.next()
                        log.warning("claim failed (%s); retrying in %.1fs", err, delay)
                        await asyncio.sleep(delay)
                        continue
                    backoff.reset()
                    try:
                        leases = [Lease(item) for item in decode(response).get("leases", [])]
                    except (BatonError, KeyError, TypeError, ValueError) as exc:
                        log.error("claim answered something unexpected (%s); retrying", exc)
                        await asyncio.sleep(backoff.next())
                        continue
                    if not leases:
                        if time.monotonic() - sent < 0.05:
                            await asyncio.sleep(0.2)  # e.g. the server is shutting down
                        continue
                    jobs = [Job(lease, worker.queue, worker.name, sent) for lease in leases]
                    worker._renewer.add(jobs)
                    if self._stopping or not worker._hand_over(jobs):
                        self._release(jobs)  # blocking (a rare path): not cut short by a cancel
            except asyncio.CancelledError:
                pass

    def _release(self, jobs: List[Job]) -> None:
        """Hands back leases claimed while stopping, in one request (a courtesy: without it they
        come back after the claim timeout)."""
        body = dumps({"settlements": [{"lease": job.lease, "outcome": "release"} for job in jobs]})
        try:
            with httpx.Client(timeout=5.0) as client:
                response = client.post(self._release_url, content=body, headers=self._headers)
            if response.status_code >= 400:
                log.warning("releasing %d command(s) failed: %s", len(jobs), error_of(response))
        except httpx.HTTPError as exc:
            log.warning("releasing %d command(s) failed: %s", len(jobs), exc)
        for job in jobs:
            self._worker._renewer.remove(job)


class _Pending:
    """One settlement on its way: the job, the body fields, and its retry state."""

    __slots__ = ("job", "fields", "what", "item", "done", "not_before", "backoff", "retried", "alone", "dropped")

    def __init__(self, job: Job, fields: Dict[str, Any], what: str, done: "asyncio.Future[None]") -> None:
        self.job = job
        self.done = done
        self.not_before = 0.0
        self.backoff = _Backoff()
        self.retried = False  # sent before without a definite answer: lease_lost then means applied
        self.alone = False  # refused as part of a batch (413, a 400 naming no item): sent on its own
        self.dropped = False  # given up (the worker stops)
        self.fields: Dict[str, Any] = {}
        self.what = ""
        self.item = b""
        self.set(fields, what)

    def set(self, fields: Dict[str, Any], what: str) -> None:
        self.fields = fields
        self.what = what
        self.item = _settle_body(self.job.lease, fields)


_ITEM_INDEX = re.compile(r"^settlements\[(\d+)\]: ?")


class _Settler:
    """Settles finished jobs, many per request: every settlement ready when a request goes
    out is sent in it (``{"settlements": [...]}``, at most :data:`_MAX_SETTLE` and about
    :data:`_SETTLE_BATCH_BYTES`), so under load one request settles many commands. A thread
    sends (:data:`_SETTLE_THREADS`), with its own synchronous ``httpx.Client`` (cheaper per
    request than the async client, and independent of the worker's event loop); while a
    request is in flight the next settlements gather for the next one.

    Transient failures (no answer, ``408``/``429``/``5xx``, an item's backend error) say
    nothing about the lease: they are retried with backoff (the lease is renewed meanwhile)
    until the server answers. An item's ``lease_lost`` ends it (after a retry it may mean the
    earlier try was applied). A stopping worker gives up after :data:`_SETTLE_ON_STOP` seconds
    (:meth:`give_up`)."""

    def __init__(self, worker: "Worker", threads: int) -> None:
        self._worker = worker
        self._url = f"{worker.url}/v1/queues/{seg(worker.queue)}/workers/{seg(worker.name)}/settle"
        self._headers = {**base_headers(worker._token), **JSON_HEADERS}
        self._cond = threading.Condition()
        self._ready: "collections.deque[_Pending]" = collections.deque()
        self._later: List[_Pending] = []  # waiting for their retry time
        self._inflight: List[List[_Pending]] = []  # the batches being sent
        self._stopping = False
        self._given_up = False
        self._backoff = _Backoff()  # of whole requests (no answer, 5xx)
        self._threads = [
            threading.Thread(target=self._run, name=f"baton-settle-{worker.name}-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def put(self, job: Job, settlement: Tuple[Dict[str, Any], str], done: "asyncio.Future[None]") -> None:
        fields, what = settlement
        pending = _Pending(job, fields, what, done)
        with self._cond:
            self._ready.append(pending)
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is pending (retrying for up to ``timeout`` seconds), then end the threads
        (after :meth:`give_up`, a thread still waiting for an answer is left behind)."""
        with self._cond:
            self._stopping = True
            if self._given_up:
                timeout = min(timeout, 0.5)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    def give_up(self) -> None:
        """Drop the settlements still waiting for an answer (the worker stops; thread-safe)."""
        with self._cond:
            self._given_up = True
            dropped = list(self._ready) + self._later + [p for batch in self._inflight for p in batch]
            self._ready.clear()
            self._later = []
            for p in dropped:
                p.dropped = True
            self._cond.notify_all()
        _drop(dropped)

    # --- the sending threads ---

    def _take(self) -> Optional[List[_Pending]]:
        """The next batch (waiting for one); ``None`` when stopping with nothing left."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._later:
                    due = [p for p in self._later if p.not_before <= now]
                    if due:
                        self._later = [p for p in self._later if p.not_before > now]
                        self._ready.extend(due)
                if self._ready:
                    return self._batch()
                if self._stopping and not self._later:
                    return None
                wait = min(p.not_before for p in self._later) - now if self._later else None
                self._cond.wait(wait)

    def _batch(self) -> List[_Pending]:
        ready = self._ready
        first = ready.popleft()
        batch = [first]
        if first.alone:
            return batch
        size = len(first.item)
        while ready and len(batch) < _MAX_SETTLE:
            nxt = ready[0]
            if nxt.alone or size + len(nxt.item) + 1 > _SETTLE_BATCH_BYTES:
                break
            size += len(nxt.item) + 1
            batch.append(ready.popleft())
        return batch

    def _again(self, items: List[_Pending], delay: float = 0.0) -> None:
        """Back in line: at the front now, or after ``delay`` seconds."""
        if not items:
            return
        dropped: List[_Pending] = []
        with self._cond:
            if self._given_up:  # the worker stops: what comes back is dropped
                dropped = [p for p in items if not p.dropped]
                for p in dropped:
                    p.dropped = True
            elif delay <= 0:
                self._ready.extendleft(reversed(items))
            else:
                at = time.monotonic() + delay
                for p in items:
                    p.not_before = at
                self._later.extend(items)
            self._cond.notify()
        _drop(dropped)

    def _run(self) -> None:
        with httpx.Client(timeout=self._worker._timeout) as client:
            while True:
                batch = self._take()
                if batch is None:
                    return
                finished: List[_Pending] = []
                with self._cond:
                    self._inflight.append(batch)
                try:
                    finished = self._send(client, batch)
                except Exception:  # pragma: no cover - a bug in the SDK: keep settling others
                    log.exception("internal error while settling %d command(s)", len(batch))
                    finished = batch
                finally:
                    with self._cond:
                        self._inflight.remove(batch)
                if finished:
                    loop = finished[0].done.get_loop()
                    try:
                        loop.call_soon_threadsafe(_resolve_all, [p.done for p in finished])
                    except RuntimeError:  # the loop is closed
                        pass

    def _send(self, client: httpx.Client, batch: List[_Pending]) -> List[_Pending]:
        """Sends one request for ``batch``; returns the settlements that are finished (the
        others are back in line)."""
        finished: List[_Pending] = []
        live: List[_Pending] = []
        for p in batch:
            if p.job._lost:
                log.warning("command %s: not settling it (%s): the server said its lease is lost", p.job.id, p.what)
                finished.append(p)
            else:
                live.append(p)
        if not live:
            return finished
        body = b'{"settlements":[' + b",".join(p.item for p in live) + b"]}"
        log.debug("settle request: %d settlement(s)", len(live))
        try:
            response = client.post(self._url, content=body, headers=self._headers)
        except httpx.HTTPError as exc:
            delay = self._backoff.next()
            log.warning(
                "settling %s failed (%s: %s); retrying in %.1fs", _which(live), type(exc).__name__, exc, delay
            )
            for p in live:
                p.retried = True
            self._again(live, delay)
            return finished
        status = response.status_code
        if status == 200:
            self._backoff.reset()
            try:
                answers = decode(response)["settlements"]
                if not isinstance(answers, list) or len(answers) != len(live):
                    raise ValueError(f"{len(answers)} answers to {len(live)} settlements")
            except (BatonError, KeyError, TypeError, ValueError) as exc:
                delay = self._backoff.next()
                log.error("settle answered something unexpected (%s); retrying in %.1fs", exc, delay)
                for p in live:
                    p.retried = True
                self._again(live, delay)
                return finished
            retry: List[_Pending] = []
            for p, answer in zip(live, answers):
                if self._answered(p, answer):
                    finished.append(p)
                else:
                    retry.append(p)
            if retry:
                delay = max(p.backoff.next() for p in retry)
                self._again(retry, delay)
            return finished
        err = error_of(response)
        if status in (408, 429) or status >= 500:
            delay = err.retry_after if err.retry_after is not None else self._backoff.next()
            log.warning("settling %s failed (%s); retrying in %.1fs", _which(live), err, delay)
            for p in live:
                p.retried = True
            self._again(live, delay)
            return finished
        if status in (400, 413):
            # The whole request is refused, nothing settled. A 400 names the item at fault;
            # without one (413: too big together) each is sent on its own.
            match = _ITEM_INDEX.match(err.message)
            index = int(match.group(1)) if match and status == 400 else None
            if index is None and len(live) == 1:
                index = 0
            if index is None or index >= len(live):
                for p in live:
                    p.alone = True
                self._again(live)
                return finished
            bad = live[index]
            if match:
                err.message = err.message[match.end() :]
            if self._refused(bad, status, err):
                finished.append(bad)
                self._again(live[:index] + live[index + 1 :])
            else:
                self._again(live)
            return finished
        for p in live:
            log.error("command %s: settling %s refused: %s", p.job.id, p.what, err)
        return batch

    def _answered(self, p: _Pending, answer: Any) -> bool:
        """One item's answer: ``True`` when that settlement is finished."""
        job = p.job
        if not isinstance(answer, dict) or answer.get("lease") not in (None, job.lease):
            log.error("command %s: settle answered something unexpected (%r); not retrying", job.id, answer)
            return True
        if "applied" in answer:
            log.debug("command %s settled: %s (applied: %s)", job.id, p.what, answer.get("applied"))
            return True
        code = answer.get("error")
        message = answer.get("message", "")
        if code == "lease_lost":
            if p.retried and job._renewal_end != "lost":
                # An earlier try may have been applied (its answer did not reach us): a renewal
                # said the lease is gone (settled), or said nothing either way.
                log.debug("command %s: a retried settlement answered lease_lost (the first was applied)", job.id)
            else:
                log.warning(
                    "command %s: settling %s refused, the lease is lost (%s); another worker may run it",
                    job.id, p.what, message,
                )
            return True
        p.retried = True
        log.warning("settling command %s failed (%s: %s); retrying", job.id, code, message)
        return False

    def _refused(self, p: _Pending, status: int, err: BatonError) -> bool:
        """The server refused this settlement's body (``400``/``413``): settle something it
        takes instead when there is one (``False``: send it again), else give up (``True``)."""
        job, outcome = p.job, p.fields.get("outcome")
        p.alone = False
        if outcome == "handed_off":
            target = p.fields.get("queue")
            log.error(
                "command %s: the server refused the hand-off to queue %r (%s); settling it failed", job.id, target, err
            )
            p.set(
                {"outcome": "failed", "error": f"the handler handed the command off to queue {target!r}, which the server refused: {err.message}"},
                "failed (hand-off refused)",
            )
            return False
        if outcome == "succeeded" and status in (400, 413):
            log.error("command %s: the server refused the result (%s); settling it as an error", job.id, err)
            p.set({"outcome": "error", "error": f"the server refused the handler's result: {err}"}, "error (result refused)")
            return False
        log.error("command %s: settling %s refused: %s", job.id, p.what, err)
        return True


def _drop(items: List[_Pending]) -> None:
    """Gives up on these settlements (the worker stops): their jobs end unsettled."""
    for p in items:
        log.warning(
            "command %s: gave up settling it (%s): no answer from the server before the worker stopped; "
            "its lease lapses and the command is delivered again",
            p.job.id, p.what,
        )
    if items:
        try:
            items[0].done.get_loop().call_soon_threadsafe(_resolve_all, [p.done for p in items])
        except RuntimeError:  # the loop is closed
            pass


def _which(items: List[_Pending]) -> str:
    return f"command {items[0].job.id}" if len(items) == 1 else f"{len(items)} commands"


def _resolve_all(futs: List["asyncio.Future[None]"]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)


# What a job ended with: (body fields without "lease", description) or None (do not settle).
_Settlement = Optional[Tuple[Dict[str, Any], str]]


class Worker:
    """Runs handlers for the commands of one queue, as a remote worker of ``baton serve``.

    Args:
        url: the server's base URL (``http://127.0.0.1:7700``).
        queue: the queue to work on.
        handler: ``def handler(job)`` or ``async def handler(job)``, or a dict
            ``{command type: handler}`` (a command of a type without a handler ends ``FAILED``
            with a message naming the types handled). A plain ``def`` runs in its own thread
            and may block; an ``async def`` runs in the worker's event loop. What the handler
            does decides the outcome:

            - returns a value → ``SUCCEEDED`` with it as ``result`` (JSON-serializable, or
              :class:`RawJSON`; a value that is not is settled as a handler error);
            - raises (or returns) :class:`Failed` → ``FAILED`` with its message;
            - raises anything else → a handler error: retried with backoff by the server,
              up to the queue's ``retry.max_attempts``, then ``FAILED``;
            - returns :class:`Running` → ``RUNNING``: a ``check_status`` call comes later;
            - returns :class:`HandOff` → ``RUNNING`` on another queue (one the server does not
              have, or the command's own, is refused: the worker settles ``FAILED`` naming it);
            - returns :class:`Release` → handed back unrun.
        concurrency: handlers running at once (claims ask for the free slots only).
        name: the worker's name (1–128 bytes); default ``<host>-<pid>-<random>``.
        token: a bearer token with ``work`` on the queue.
        claim_wait: how long one claim long-polls when nothing is ready (seconds or ``"20s"``;
            the server cuts a longer wait than its ``--long-poll-timeout``, 30 s by default).
        shutdown_grace: seconds in-flight handlers get to finish after :meth:`stop` before their
            cancellation signal fires (reason ``SHUTDOWN``).
        cancel_grace: seconds a handler signalled for shutdown gets to end before its lease is
            released anyway; a handler that ends by returning an outcome in that time has it
            settled, one that raises has its lease released.
        handle_signals: install ``SIGTERM``/``SIGINT`` handlers in :meth:`run` (main thread
            only): the first calls :meth:`stop`, a second one skips the grace period.
        timeout: the HTTP timeout of settle requests, seconds.

    Leases are renewed for all held commands in one request every third of the queue's
    claim timeout, from a process of its own (started by :meth:`run` with ``sys.executable``;
    it has its own GIL), so a lease holds whatever the handler does: blocking the event loop
    in an ``async def``, or holding the GIL in one long C call. That process exits when the
    worker process dies, so a dead worker's leases lapse. Claims run in a thread of their own.
    On a renewal saying the command was cancelled, the job's signal fires
    (``CancelReason.CANCELLED``), an async handler's task is cancelled, and ``cancelled`` is
    settled when the handler ends. Only the server ends a lease: on a renewal saying ``lost``
    or ``gone`` the signal fires (``CancelReason.LEASE_LOST``) and nothing is ever settled for
    it. Renewals and settlements that get no answer (a network failure, a timeout, ``5xx``)
    say nothing about the lease: the handler keeps running and they are retried.
    """

    def __init__(
        self,
        url: str,
        queue: str,
        handler: Union[Handler, Mapping[str, Handler]],
        *,
        concurrency: int = 16,
        name: Optional[str] = None,
        token: Optional[str] = None,
        claim_wait: Duration = "20s",
        shutdown_grace: float = 10.0,
        cancel_grace: float = 2.0,
        handle_signals: bool = False,
        timeout: float = 30.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.url = url.rstrip("/")
        self.queue = queue
        self.name = name if name is not None else default_worker_name()
        if not 1 <= len(self.name.encode()) <= 128:
            raise ValueError("a worker name is 1 to 128 bytes")
        self.concurrency = concurrency
        self.shutdown_grace = shutdown_grace
        self.cancel_grace = cancel_grace
        self.handle_signals = handle_signals
        self._token = token
        self._timeout = timeout
        self._claim_wait = format_duration(claim_wait)
        self._claim_wait_seconds = duration_seconds(claim_wait)
        self._handlers: Optional[Dict[str, Tuple[Handler, bool]]]
        self._handler: Optional[Tuple[Handler, bool]]
        if isinstance(handler, Mapping):
            self._handlers = {str(t): (h, _is_async(h)) for t, h in handler.items()}
            self._handler = None
        elif callable(handler):
            self._handlers = None
            self._handler = (handler, _is_async(handler))
        else:
            raise TypeError("handler must be a callable or a dict {command type: callable}")
        self._slots = threading.Lock()
        self._busy = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop_requested: Optional[asyncio.Event] = None
        self._stop_now = False
        self._stopping = False
        self._pending_stop = 0
        self._fatal: Optional[BatonError] = None
        self._tasks: Dict[str, "asyncio.Task[None]"] = {}
        self._jobs: Dict[str, Job] = {}
        self._renewer: _Renewer
        self._claimer: _Claimer
        self._settler: _Settler
        self._running = False
        self._loop_thread = 0

    # --- public ---

    def stop(self, now: bool = False) -> None:
        """Ask the worker to stop (thread-safe; also safe before :meth:`run` starts).

        It stops claiming, lets in-flight handlers run for ``shutdown_grace`` seconds, then
        signals them (``CancelReason.SHUTDOWN``) and releases the leases of those that do not
        end with an outcome within ``cancel_grace``. ``now=True`` (or a second call) skips
        the grace period.
        """
        loop = self._loop
        if loop is None or not self._running:
            self._pending_stop += 2 if now else 1
            return
        try:
            if threading.get_ident() == self._loop_thread:
                self._request_stop(now)
            else:
                loop.call_soon_threadsafe(self._request_stop, now)
        except RuntimeError:
            pass

    @property
    def active_jobs(self) -> List[Job]:
        """The jobs being worked on (a snapshot)."""
        return list(self._jobs.values())

    def run_sync(self) -> None:
        """``asyncio.run(self.run())``: run in a new event loop until stopped."""
        asyncio.run(self.run())

    async def run(self) -> None:
        """Claim and run commands until :meth:`stop` (or ``SIGTERM``/``SIGINT`` with
        ``handle_signals``); returns after the graceful shutdown.

        Raises:
            BatonError: the server refused the claims for good (``404 unknown_queue``,
                ``401``/``403``, ``400``); raised after in-flight jobs were shut down.
            RuntimeError: the worker is already running, or its lease renewal process
                (``sys.executable``) did not start.
        """
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        self._stopping = False
        self._stop_now = False
        self._fatal = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop_requested = asyncio.Event()
        self._settler = _Settler(self, min(self.concurrency, _SETTLE_THREADS))
        self._renewer = _Renewer(self)
        self._claimer = _Claimer(self, self._claim_wait, self._claim_wait_seconds)
        installed: List[int] = []
        try:
            # The renewal process runs before anything is claimed (it takes a moment to start).
            await self._loop.run_in_executor(None, self._renewer.start)
        except BaseException:  # it did not start, or run() was cancelled meanwhile
            threading.Thread(target=self._renewer.stop, daemon=True).start()
            self._running = False
            self._loop = None
            raise
        if self.handle_signals:
            installed = self._install_signals()
        try:
            if self._pending_stop:
                self._request_stop(self._pending_stop > 1)
                self._pending_stop = 0
            self._settler.start()
            self._claimer.start()
            log.info("worker %s on queue %s (concurrency %d) started", self.name, self.queue, self.concurrency)
            try:
                await self._stop_requested.wait()
            except asyncio.CancelledError:
                # run() itself was cancelled: shut down without the grace period, then re-raise.
                self._request_stop(True)
                await self._shutdown()
                raise
            await self._shutdown()
        finally:
            for sig in installed:
                try:
                    self._loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
            self._claimer.stop()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._settler.stop)
            # Last: leases are renewed while their settlements are on their way.
            await loop.run_in_executor(None, self._renewer.stop)
            self._running = False
            self._loop = None
        if self._fatal is not None:
            raise self._fatal

    # --- shutdown ---

    def _install_signals(self) -> List[int]:
        assert self._loop is not None
        installed: List[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                log.warning("cannot handle %s here (%s): stop the worker with stop()", sig.name, exc)
        return installed

    def _on_signal(self, sig: int) -> None:
        log.info("%s: stopping (again to skip the grace period)", signal.Signals(sig).name)
        self._request_stop(self._stopping)

    def _request_stop(self, now: bool) -> None:
        if now:
            self._stop_now = True
        self._stopping = True
        if self._stop_requested is not None:
            self._stop_requested.set()
        if self._stop_now and self._grace_waiter is not None and not self._grace_waiter.done():
            self._grace_waiter.cancel()

    _grace_waiter: Optional["asyncio.Future[Any]"] = None

    async def _shutdown(self) -> None:
        self._claimer.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._claimer.join, 5.0)
        await asyncio.sleep(0)  # jobs the claimer handed over before it stopped are released
        tasks = set(self._tasks.values())
        if tasks:
            if not self._stop_now:
                log.info("stopping: waiting up to %.1fs for %d handler(s)", self.shutdown_grace, len(tasks))
                self._grace_waiter = asyncio.ensure_future(asyncio.wait(tasks, timeout=self.shutdown_grace))
                try:
                    await self._grace_waiter
                except asyncio.CancelledError:
                    if not self._stop_now:
                        raise
                finally:
                    self._grace_waiter = None
            remaining = [self._jobs[lease] for lease, task in self._tasks.items() if not task.done()]
            for job in remaining:
                job._signal(CancelReason.SHUTDOWN)
            tasks = {t for t in self._tasks.values() if not t.done()}
            if tasks:
                await asyncio.wait(tasks, timeout=self.cancel_grace)
            for lease, task in list(self._tasks.items()):
                if not task.done():
                    abandon = self._jobs[lease]._abandon
                    if abandon is not None and not abandon.done():
                        abandon.set_result(None)
            tasks = set(self._tasks.values())
            if tasks:
                # What is left is settling (retried while the server does not answer): it gets
                # _SETTLE_ON_STOP seconds, then the worker gives up on it (the leases lapse when
                # the worker is gone, and the commands run again elsewhere).
                await asyncio.wait(tasks, timeout=_SETTLE_ON_STOP)
                if any(not t.done() for t in tasks):
                    self._settler.give_up()
                    await asyncio.wait(tasks)
        log.info("worker %s stopped", self.name)

    # --- slots (shared with the claim thread) ---

    def _free_slots(self) -> int:
        with self._slots:
            return self.concurrency - self._busy

    def _claimer_failed(self, err: BatonError) -> None:
        loop = self._loop
        if loop is None:
            return

        def fail() -> None:
            if self._fatal is None:
                self._fatal = err
            self._request_stop(False)

        try:
            loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass

    def _hand_over(self, jobs: List[Job]) -> bool:
        """From the claim thread: take the slots and start the jobs in the worker's loop.
        ``False`` when the loop is gone (the caller releases the leases)."""
        loop = self._loop
        if loop is None:
            return False
        with self._slots:
            self._busy += len(jobs)
        try:
            loop.call_soon_threadsafe(self._start_jobs, jobs)
        except RuntimeError:
            with self._slots:
                self._busy -= len(jobs)
            return False
        return True

    def _start_jobs(self, jobs: List[Job]) -> None:
        for job in jobs:
            job._loop = self._loop
            job._report_to = self._renewer.report
            if job._cancelled.is_set() and job._async_event is not None:
                job._async_event.set()
            self._jobs[job.lease] = job
            self._tasks[job.lease] = asyncio.ensure_future(self._run_job(job))

    def _job_done(self, job: Job) -> None:
        self._renewer.remove_soon(job, asyncio.get_running_loop())
        self._jobs.pop(job.lease, None)
        self._tasks.pop(job.lease, None)
        with self._slots:
            self._busy -= 1
        self._claimer.wake()

    # --- running a job ---

    async def _run_job(self, job: Job) -> None:
        try:
            if self._stopping:
                settlement: _Settlement = ({"outcome": "release"}, "released (the worker is stopping)")
            else:
                settlement = await self._execute(job)
            await self._settle(job, settlement)
        except Exception:  # pragma: no cover - a bug in the SDK: keep the worker alive
            log.exception("internal error while running command %s", job.id)
        finally:
            self._job_done(job)

    def _handler_for(self, job: Job) -> Optional[Tuple[Handler, bool]]:
        if self._handlers is None:
            return self._handler
        return self._handlers.get(job.type)

    async def _execute(self, job: Job) -> _Settlement:
        loop = asyncio.get_running_loop()
        if not job._confirmed.is_set() and job._reason is None:
            # The claim's answer reached us late: the lease may have lapsed and the command gone
            # to another worker. Start only once a renewal says it is held (or not at all).
            job._wake = asyncio.Event()
            if not job._confirmed.is_set() and job._reason is None:
                log.debug("command %s: claimed %.1fs ago; waiting for a renewal to hold it", job.id,
                          time.monotonic() - job.claimed_at)
                await job._wake.wait()
        if job._reason is not None:  # signalled before it started
            return self._settlement_for_signal(job, None)
        found = self._handler_for(job)
        if found is None:
            types = ", ".join(sorted(self._handlers or {})) or "none"
            msg = f"no handler for command type {job.type!r} in worker {self.name} (it handles: {types})"
            return {"outcome": "failed", "error": msg}, "failed (no handler)"
        handler, is_async = found
        fut: "asyncio.Future[Any]"
        if is_async:
            fut = job._task = asyncio.ensure_future(_call_async(handler, job))
        else:
            fut = _run_in_thread(loop, handler, job)
        abandon: "asyncio.Future[None]" = loop.create_future()
        job._abandon = abandon
        await asyncio.wait({fut, abandon}, return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            # Shutdown gave up on the handler: hand the command back.
            if is_async:
                fut.cancel()
            else:
                fut.add_done_callback(_drain)
            log.warning("command %s: the handler did not end after the shutdown signal; releasing it", job.id)
            return {"outcome": "release"}, "released (shutdown)"
        return self._settlement_of(job, fut)

    def _settlement_for_signal(self, job: Job, exc: Optional[BaseException]) -> _Settlement:
        reason = job._reason
        if reason is CancelReason.LEASE_LOST or job._lost:
            return None
        if reason is CancelReason.CANCELLED:
            return {"outcome": "cancelled"}, "cancelled"
        return {"outcome": "release"}, "released (shutdown)"

    def _settlement_of(self, job: Job, fut: "asyncio.Future[Any]") -> _Settlement:
        exc: Optional[BaseException]
        if fut.cancelled():
            exc = asyncio.CancelledError()
        else:
            exc = fut.exception()
        reason = job._reason
        if reason is CancelReason.LEASE_LOST or job._lost or reason is CancelReason.CANCELLED:
            return self._settlement_for_signal(job, exc)
        if exc is not None:
            if reason is CancelReason.SHUTDOWN:
                return {"outcome": "release"}, "released (shutdown)"
            if isinstance(exc, Failed):
                return {"outcome": "failed", "error": exc.message}, "failed"
            message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("command %s: the handler raised %s", job.id, message, exc_info=exc)
            return {"outcome": "error", "error": message}, "error"
        return _settlement_of_value(job, fut.result())

    async def _settle(self, job: Job, settlement: _Settlement) -> None:
        with job._lock:
            job._ended = True  # reports do nothing from now on
            reported = job._reported
        if settlement is None:
            log.info("command %s: lease lost; not settling", job.id)
            return
        if reported and settlement[0]["outcome"] != "cancelled" and not job._lost:
            # The handler's last report first (a final progress, or the checkpoint a retry, a
            # release or a check_status call resumes from): it goes with a renewal, which must
            # come before the settlement ends the lease.
            await self._renewer.flush(job, _FLUSH_WAIT_ON_STOP if self._stopping else _FLUSH_WAIT)
        with job._lock:
            if job._lost:
                return
            job._settling = True
        done: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
        self._settler.put(job, settlement, done)
        await done


def _settle_body(lease: str, fields: Dict[str, Any]) -> bytes:
    result = fields.get("result")
    if isinstance(result, RawJSON):
        rest = dict(fields)
        del rest["result"]
        head = dumps({"lease": lease, **rest})
        return head[:-1] + b',"result":' + result.text.encode() + b"}"
    return dumps({"lease": lease, **fields})


def _settlement_of_value(job: Job, value: Any) -> _Settlement:
    if isinstance(value, Running):
        fields: Dict[str, Any] = {"outcome": "running"}
        if value.next_check is not None:
            fields["next_check"] = format_duration(value.next_check)
        return fields, "running"
    if isinstance(value, HandOff):
        return {"outcome": "handed_off", "queue": value.queue}, f"handed off to {value.queue}"
    if isinstance(value, Release):
        return {"outcome": "release"}, "released"
    if isinstance(value, Failed):
        return {"outcome": "failed", "error": value.message}, "failed"
    if isinstance(value, RawJSON):
        return {"outcome": "succeeded", "result": value}, "succeeded"
    try:
        dumps(value)
    except (TypeError, ValueError) as exc:
        msg = f"the handler's result is not JSON-serializable: {type(exc).__name__}: {exc}"
        log.error("command %s: %s", job.id, msg)
        return {"outcome": "error", "error": msg}, "error (result not JSON)"
    return {"outcome": "succeeded", "result": value}, "succeeded"


async def _call_async(handler: Handler, job: Job) -> Any:
    value = handler(job)
    while inspect.isawaitable(value):
        value = await value
    return value


def _drain(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled():
        fut.exception()  # retrieve it, so asyncio does not log "never retrieved"


def _run_in_thread(loop: asyncio.AbstractEventLoop, handler: Handler, job: Job) -> "asyncio.Future[Any]":
    """Run a plain handler in a daemon thread of its own (so a handler that ignores its
    cancellation cannot keep the process alive); the future resolves in ``loop``."""
    fut: "asyncio.Future[Any]" = loop.create_future()

    def resolve(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value = handler(job)
            if inspect.isawaitable(value):  # a plain callable that returned a coroutine
                value = asyncio.run_coroutine_threadsafe(_await(value), loop).result()
            ok, out = True, value
        except BaseException as exc:  # noqa: BLE001 - handed to the loop as the outcome
            ok, out = False, exc
        try:
            loop.call_soon_threadsafe(resolve, ok, out)
        except RuntimeError:  # the loop is closed: the worker has stopped
            pass

    threading.Thread(target=target, name=f"baton-job-{job.id}", daemon=True).start()
    return fut


async def _await(value: Awaitable[Any]) -> Any:
    return await value


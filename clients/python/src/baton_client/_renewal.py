"""Lease renewals in a process of their own (the worker's renewal process).

The worker starts this module in a child interpreter (``subprocess``, ``sys.executable -c
BOOT``: it loads this file alone, not the package, so that the child starts fast: it imports
httpx and the standard library only) and tells it, through the child's stdin, which leases it
holds; the child renews them
(one ``renew`` request for all of them, every third of the shortest lease timeout) and writes
back, through its stdout, what the server answered that the worker must act on. A separate
process has its own GIL: a handler that holds the worker's GIL for a long time (one long C
call) cannot delay a renewal.

Only a definite answer about a lease ends it here: a renewal item saying ``lost`` or
``gone``. A request that fails (no answer, a timeout, ``5xx``, anything but a ``200`` with the
items) says nothing about the leases: they stay held and the renewal is tried again soon.

The child lives only as long as the worker process: it exits without renewing again when its
stdin reaches end of file (the worker closed it, or died: the kernel closes a dead process's
pipes) or its parent process changes (``os.getppid()``, checked before every request and at
least every :data:`_PARENT_CHECK` seconds; it covers a dead worker whose pipe is still open in a
process it forked). So a killed worker's leases lapse after the claim timeout, as they should.
It ignores ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` (a Ctrl-C in a terminal, or a service manager
signalling the whole group, is the worker's to handle: its graceful shutdown needs its leases).
While the worker process is stopped (``SIGSTOP``, Ctrl-Z; seen in ``/proc`` on Linux) it
renews nothing: a suspended worker's leases lapse, as they would if it renewed them
itself.

Messages are JSON, one per line. To the child: first the configuration
``{"url" (of the renew route), "headers", "parent" (pid), "path" (sys.path), "module" (this
file)}``, then ``{"add": [[lease, timeout
seconds, age seconds, confirm], ...]}``, ``{"remove": [lease, ...]}``, ``{"report": [lease,
progress, details]}`` (a handler's report, each part the JSON text of its renewal item field or
``null``) and ``{"flush": lease}`` (renew at once if the lease has a report not written yet).
From the child: ``{"ready": pid}``, ``{"leases": [[lease, state, cancelled], ...]}`` (``lost``
and ``gone`` always; ``held`` when ``cancelled`` is first seen, or for the first answer about a
lease added with ``confirm``), ``{"flushed": lease}`` (the renewal a ``flush`` asked for is
over, or there was nothing to send) and ``{"log": [level, message]}``.

Progress and checkpoints (docs/workers.md) ride on the renewals: the latest report of each
lease, progress and details merged (the latest of each part wins), goes with its next renewal
as ``{"lease", "progress"?, "details"?}``, and is done once that renewal answers ``held`` (a
part reported again meanwhile is kept for the next one); a renewal that fails keeps it for the
next try. Reports are checked by the worker before they get here (the server refuses a whole
renewal for one malformed item); should the server refuse one all the same, the renewal is
repeated at once without it, and a warning logged.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any, BinaryIO, Dict, List, Optional, Set, Tuple

import httpx

#: What the worker runs in the child: read the configuration line, take the worker's
#: ``sys.path`` (so that httpx imports as it does in the worker), load this file, run
#: :func:`main`. (The first line names it in ``ps``.)
BOOT = (
    "# baton_client._renewal: the lease renewal process of a Baton worker\n"
    "import json, sys, importlib.util\n"
    "cfg = json.loads(sys.stdin.buffer.readline() or b'null')\n"
    "if cfg is None: sys.exit(0)\n"
    "sys.path[:0] = [p for p in cfg.pop('path') if p not in sys.path]\n"
    "spec = importlib.util.spec_from_file_location('baton_client_renewal', cfg.pop('module'))\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module.main(cfg)\n"
)

_MAX_RENEW = 1000  # the server's limit of leases in one renewal
_RENEW_BATCH_BYTES = 256 * 1024  # a renewal's body stays well under --max-command-body (1 MiB)
_PARENT_CHECK = 0.2  # seconds between checks that the worker process still lives


class _Lease:
    __slots__ = ("token", "timeout", "claimed_at", "confirm", "cancelled", "progress", "details")

    def __init__(self, token: str, timeout: float, claimed_at: float, confirm: bool) -> None:
        self.token = token
        self.timeout = timeout
        self.claimed_at = claimed_at
        self.confirm = confirm  # report the first answer, "held" included
        self.cancelled = False  # "cancelled: true" reported
        self.progress: Optional[str] = None  # reported, not written yet (JSON text)
        self.details: Optional[str] = None

    def has_report(self) -> bool:
        return self.progress is not None or self.details is not None

    def item(self) -> str:
        """Its renewal item: the lease, or ``{"lease", "progress"?, "details"?}``."""
        token = json.dumps(self.token)
        if not self.has_report():
            return token
        text = '{"lease":' + token
        if self.progress is not None:
            text += ',"progress":' + self.progress
        if self.details is not None:
            text += ',"details":' + self.details
        return text + "}"


class _Renewals:
    def __init__(self, cfg: Dict[str, Any], out: BinaryIO) -> None:
        self._url = str(cfg["url"])
        self._headers = dict(cfg["headers"])
        self._parent = int(cfg["parent"])
        self._out = out
        self._out_lock = threading.Lock()
        self._cond = threading.Condition()
        self._held: Dict[str, _Lease] = {}
        self._next_at = 0.0  # when the next renewal is due
        self._added_due = float("inf")  # the earliest due of the leases added during a renewal
        self._failures = 0
        self._backoff = 0.0
        self._flush: Set[str] = set()  # leases whose worker waits for their report to go out

    # --- the worker's side of the pipes ---

    def parent_alive(self) -> bool:
        return os.getppid() == self._parent

    def parent_suspended(self) -> bool:
        """Whether the worker process is stopped (``SIGSTOP``, ``SIGTSTP``): it works on nothing
        then, so its leases are not renewed (Linux; elsewhere ``False``)."""
        try:
            with open(f"/proc/{self._parent}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        # "T": stopped by a signal. ("t", stopped by a tracer, is not counted: strace stops
        # its tracee at every system call.)
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"

    def send(self, message: Dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            with self._out_lock:
                self._out.write(data)
                self._out.flush()
        except (OSError, ValueError):  # the worker is gone
            os._exit(0)

    def log(self, level: int, message: str) -> None:
        self.send({"log": [level, message]})

    def read_commands(self, stdin: BinaryIO) -> None:
        """The reader thread: applies the worker's messages; exits the process at end of file."""
        try:
            for line in stdin:
                message = json.loads(line)
                with self._cond:
                    for token, timeout, age, confirm in message.get("add", ()):
                        now = time.monotonic()
                        lease = _Lease(str(token), float(timeout), now - float(age), bool(confirm))
                        idle = not self._held
                        self._held[lease.token] = lease
                        # Renew it a third of its timeout after its claim at the latest (at once
                        # when that is past: a claim answered late, or a restarted renewer).
                        due = lease.claimed_at + lease.timeout / 3.0
                        self._next_at = due if idle else min(self._next_at, due)
                        self._added_due = min(self._added_due, due)
                    for token in message.get("remove", ()):
                        self._held.pop(token, None)
                        if token in self._flush:
                            self._flush.discard(token)
                            self.send({"flushed": token})
                    report = message.get("report")
                    if report is not None:
                        token, progress, details = report
                        lease = self._held.get(token)
                        if lease is not None:  # else: the lease is over, nothing can be written
                            if progress is not None:
                                lease.progress = str(progress)
                            if details is not None:
                                lease.details = str(details)
                    token = message.get("flush")
                    if token is not None:
                        lease = self._held.get(token)
                        if lease is not None and lease.has_report():
                            self._flush.add(token)
                            self._next_at = time.monotonic()  # renew now
                        else:
                            self.send({"flushed": token})
                    self._cond.notify()
        except Exception as exc:  # noqa: BLE001 - a bug, or a broken pipe: nothing to renew for
            try:
                self.log(logging.ERROR, f"the renewal process stops: {type(exc).__name__}: {exc}")
            finally:
                os._exit(1)
        os._exit(0)  # end of file: the worker closed the pipe or died; never renew again

    # --- renewing ---

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while True:
                with self._cond:
                    while True:
                        if not self.parent_alive():
                            os._exit(0)
                        self._flush_done(lambda lease: lease is None or not lease.has_report())
                        now = time.monotonic()
                        if not self._held:
                            wait = _PARENT_CHECK
                        elif now < self._next_at:
                            wait = min(_PARENT_CHECK, self._next_at - now)
                        elif self.parent_suspended():
                            wait = _PARENT_CHECK  # due, but the worker is stopped: not renewed
                        else:
                            break
                        self._cond.wait(wait)
                    leases = list(self._held.values())
                    flushing = set(self._flush)
                    self._added_due = float("inf")
                interval = min(lease.timeout for lease in leases) / 3.0
                sent = time.monotonic()
                ok = True
                for batch in _batches(leases):
                    if not self.parent_alive():
                        os._exit(0)
                    ok = self._renew(client, batch, interval) and ok
                with self._cond:
                    # The renewal the flushes waited for is over (written, or failed: the
                    # worker settles anyway; the report is kept for the next renewal).
                    self._flush_done(lambda lease: True, flushing)
                if ok:
                    self._backoff = 0.0
                    delay = interval
                else:
                    # No answer about the leases: they are held as far as we know. Try again
                    # soon (0.1 s doubling, at most the usual interval).
                    self._backoff = min(interval, self._backoff * 2) if self._backoff else min(interval, 0.1)
                    delay = self._backoff * random.uniform(0.8, 1.0)
                with self._cond:
                    # Leases added while this round was on its way keep their own due time; a
                    # flush asked for meanwhile renews again at once.
                    self._next_at = min(sent + delay, self._added_due)
                    if self._flush:
                        self._next_at = time.monotonic()

    def _flush_done(self, done: Any, among: Optional[Set[str]] = None) -> None:
        """Answer the flushes (of ``among``, else all) whose lease ``done(lease)`` says (under
        the lock)."""
        for token in list(self._flush if among is None else among & self._flush):
            if done(self._held.get(token)):
                self._flush.discard(token)
                self.send({"flushed": token})

    def _renew(self, client: httpx.Client, leases: List[_Lease], interval: float) -> bool:
        """One request for ``leases``; ``False`` when it brought no answer about them."""
        while True:
            tokens = [lease.token for lease in leases]
            with self._cond:
                # What each lease's item carries (its report may change while the request is out).
                sent: Dict[str, Tuple[Optional[str], Optional[str]]] = {
                    lease.token: (lease.progress, lease.details) for lease in leases if lease.has_report()
                }
                body = '{"leases":[' + ",".join(lease.item() for lease in leases) + "]}"
            try:
                response = client.post(
                    self._url,
                    content=body.encode(),
                    headers=self._headers,
                    timeout=max(1.0, min(interval, 10.0)),
                )
            except httpx.HTTPError as exc:
                self._failed(len(leases), f"{type(exc).__name__}: {exc}")
                return False
            if response.status_code in (400, 413) and sent:
                # Refused whole, nothing renewed. Reports are checked when made, so this is a
                # server that disagrees with those checks: drop the report it names (all of this
                # request's when it names none) and renew again at once, so that the leases do
                # not pay for it. Ends: every try has one report fewer.
                named = _refused_index(response)
                token = tokens[named] if named is not None and 0 <= named < len(tokens) else None
                dropped = [token] if token in sent else list(sent)
                with self._cond:
                    for t in dropped:
                        lease = self._held.get(t)
                        if lease is not None:
                            lease.progress = lease.details = None
                self.log(
                    logging.WARNING,
                    f"renewal refused (HTTP {response.status_code}: {response.text[:300]}); dropped the "
                    f"progress/details report of {len(dropped)} lease(s), renewing without it",
                )
                continue
            return self._answered(response, leases, tokens, sent)

    def _answered(
        self,
        response: httpx.Response,
        leases: List[_Lease],
        tokens: List[str],
        sent: Dict[str, Tuple[Optional[str], Optional[str]]],
    ) -> bool:
        if response.status_code != 200:
            self._failed(len(leases), f"HTTP {response.status_code}: {response.text[:300]}")
            return False
        try:
            items = response.json()["leases"]
            if not isinstance(items, list):
                raise ValueError("'leases' is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            self._failed(len(leases), f"an unexpected answer ({exc}): {response.text[:300]!r}")
            return False
        if self._failures:
            self.log(logging.INFO, f"renewals succeed again after {self._failures} failure(s)")
            self._failures = 0
        reports: List[List[Any]] = []
        with self._cond:
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    continue
                token = item.get("lease", tokens[i] if i < len(tokens) else None)
                lease = self._held.get(token) if isinstance(token, str) else None
                if lease is None:  # removed meanwhile (settled), or not ours
                    continue
                state = item.get("state")
                cancelled = bool(item.get("cancelled"))
                if state == "held":
                    # Its report is written (or, cancelled, never will be): done, but for a part
                    # reported again since.
                    progress, details = sent.get(lease.token, (None, None))
                    if progress is not None and lease.progress == progress:
                        lease.progress = None
                    if details is not None and lease.details == details:
                        lease.details = None
                    if (cancelled and not lease.cancelled) or lease.confirm:
                        reports.append([lease.token, "held", cancelled])
                    lease.cancelled = lease.cancelled or cancelled
                    lease.confirm = False
                elif state in ("lost", "gone"):
                    del self._held[lease.token]
                    reports.append([lease.token, state, cancelled])
                # Any other state says nothing definite: the lease is kept.
        if reports:
            self.send({"leases": reports})
        return True

    def _failed(self, count: int, what: str) -> None:
        self._failures += 1
        n = self._failures
        level = logging.WARNING if n in (1, 10) or n % 100 == 0 else logging.DEBUG
        self.log(level, f"renewing {count} lease(s) failed ({n} in a row; they are kept, retrying): {what}")


def _batches(leases: List[_Lease]) -> List[List[_Lease]]:
    """``leases`` in renewals of at most :data:`_MAX_RENEW` leases and about
    :data:`_RENEW_BATCH_BYTES` of body (reports included)."""
    batches: List[List[_Lease]] = []
    batch: List[_Lease] = []
    size = 0
    for lease in leases:
        n = len(lease.token) + 4
        if lease.progress is not None:
            n += len(lease.progress) * 3 + 16
        if lease.details is not None:
            n += len(lease.details) * 3 + 16
        if batch and (len(batch) >= _MAX_RENEW or size + n > _RENEW_BATCH_BYTES):
            batches.append(batch)
            batch, size = [], 0
        batch.append(lease)
        size += n
    if batch:
        batches.append(batch)
    return batches


def _refused_index(response: httpx.Response) -> Optional[int]:
    """The renewal item a ``400`` names (its ``index``, or ``leases[i]: …`` in the message)."""
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    index = body.get("index")
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    message = body.get("message")
    if isinstance(message, str) and message.startswith("leases["):
        digits = message[len("leases[") : message.find("]")]
        if digits.isdigit():
            return int(digits)
    return None


def main(cfg: Dict[str, Any]) -> None:
    """The renewal process's main (see the module's docs)."""
    for sig in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_IGN)
    renewals = _Renewals(cfg, sys.stdout.buffer)
    if not renewals.parent_alive():
        os._exit(0)
    threading.Thread(target=renewals.read_commands, args=(sys.stdin.buffer,), daemon=True).start()
    renewals.send({"ready": os.getpid()})
    try:
        renewals.run()
    except BaseException as exc:  # noqa: BLE001 - a bug: tell the worker (it starts another)
        try:
            renewals.log(logging.ERROR, f"the renewal process failed: {type(exc).__name__}: {exc}")
        finally:
            os._exit(1)


def spawn_args() -> List[str]:
    """The command line of a renewal process."""
    if not sys.executable:
        raise RuntimeError("sys.executable is not set: the worker cannot start its lease renewal process")
    return [sys.executable, "-c", BOOT]


def config(url: str, headers: Dict[str, str]) -> bytes:
    """The first line the worker writes to a renewal process: ``url`` is the renew route's,
    ``headers`` go with every request (the token's among them)."""
    cfg = {
        "url": url,
        "headers": headers,
        "parent": os.getpid(),
        "path": list(sys.path),
        "module": os.path.abspath(__file__),
    }
    return json.dumps(cfg).encode() + b"\n"

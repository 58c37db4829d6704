"""Helpers of the tests: real ``baton serve`` and ``redis-server`` processes, no mocks.

The binary is ``$BATON_BIN``, else ``<repo root>/target/debug/baton`` (built by ``cargo build``
or ``cargo test``). Redis comes from a ``redis-server`` on ``PATH`` that the fixtures start on a
free port (``$BATON_TEST_BACKENDS=memory`` runs the memory backend only).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Coroutine, List, Optional, Sequence, Tuple, TypeVar

import httpx
from baton_client import BatonClient, Worker

REPO_ROOT = Path(__file__).resolve().parents[3]

# The queues every test server has. claim_timeout 1s keeps takeovers fast; retries are quick;
# "slow" leaves a loaded machine more room where a test needs renewals to keep up; "keyed" runs at
# most one command of a concurrency key at once.
CONFIG = """
[queues.jobs]
claim_timeout = "1s"
check_status_interval = "200ms"
retry = { max_attempts = 3, initial_backoff = "100ms", backoff_factor = 1.0, max_backoff = "100ms" }

[queues.other]
claim_timeout = "1s"
check_status_interval = "200ms"

[queues.slow]
claim_timeout = "2s"

[queues.keyed]
claim_timeout = "2s"
check_status_interval = "200ms"
concurrency_per_key = 1
"""

CLAIM_TIMEOUT = 1.0
SLOW_CLAIM_TIMEOUT = 2.0  # queue "slow": tests that starve or cut off a worker for a while

T = TypeVar("T")


def backends() -> List[str]:
    """The backends under test: ``$BATON_TEST_BACKENDS``, default ``memory,redis``."""
    wanted = os.environ.get("BATON_TEST_BACKENDS", "memory,redis")
    return [b.strip() for b in wanted.split(",") if b.strip()]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def baton_binary() -> Path:
    env = os.environ.get("BATON_BIN")
    path = Path(env) if env else REPO_ROOT / "target" / "debug" / "baton"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RuntimeError(
            f"the baton binary is missing: {path} does not exist or is not executable. "
            "Build it with `cargo build -p baton` (or `cargo test`) from the repository root, "
            "or point BATON_BIN at one."
        )
    return path


def child_env() -> dict:
    """The environment without BATON_* variables (they would override the flags' defaults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}


def stop_process(proc: "subprocess.Popen[bytes]", timeout: float = 5.0, graceful: bool = True) -> None:
    """SIGTERM (SIGKILL unless ``graceful``) and wait; SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server is not on PATH: install it (apt-get install redis-server) "
                "or run the memory backend only with BATON_TEST_BACKENDS=memory"
            )
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.log = tmp / "redis.log"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp)],
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.command(b"PING") == b"+PONG":
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def command(self, *args: bytes) -> bytes:
        payload = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(payload)
            return s.recv(1024).strip()

    def flush(self) -> None:
        assert self.command(b"FLUSHALL") == b"+OK"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class BatonServer:
    url: str
    backend: str
    proc: "subprocess.Popen[bytes]"
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def start_baton(
    tmp: Path, backend: str, redis: Optional[RedisServer], config: str = CONFIG, extra_args: Sequence[str] = ()
) -> BatonServer:
    binary = baton_binary()
    cfg = tmp / "baton.toml"
    cfg.write_text(config)
    port = free_port()
    args = [str(binary), "serve", "--listen", f"127.0.0.1:{port}", "--config", str(cfg), "--no-workers", *extra_args]
    if backend == "redis":
        assert redis is not None
        redis.flush()
        args += ["--redis", redis.url]
    log = tmp / f"baton-{port}.log"
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"baton serve did not start ({' '.join(args)}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return BatonServer(url=url, backend=backend, proc=proc, log=log)


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run a test coroutine in a new event loop, failing it after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@asynccontextmanager
async def running(worker: Worker, stop_timeout: float = 15.0) -> AsyncIterator[Worker]:
    """Run ``worker`` in the current loop for the block, then stop it and wait for the end."""
    task = asyncio.ensure_future(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, stop_timeout)


@asynccontextmanager
async def client(server: BatonServer) -> AsyncIterator[BatonClient]:
    async with BatonClient(server.url) as c:
        yield c


async def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate()`` (in the loop, without blocking it) until it is true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


class FaultProxy:
    """An HTTP/1.1 proxy in front of ``baton serve``, run in the test's event loop, that answers
    chosen requests itself. One request per connection (it answers ``Connection: close``).

    A fault is a status (answered with a JSON error body) or ``"drop"`` (the connection is
    closed without an answer). ``always[suffix]`` applies to every request whose path ends with
    ``suffix`` (``"/renew"``, ``"/settle"``, ``"/claim"``); ``once[suffix]`` is a list applied to
    the next such requests, one each, before ``always``. ``seen`` counts ``(suffix or path,
    fault or "pass")``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("://", 1)[1].rsplit(":", 1)
        self._upstream = (host, int(port))
        self.always: dict = {}
        self.once: dict = {}
        self.seen: "Counter[Tuple[str, Any]]" = Counter()
        self.url = ""
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _fault(self, path: str) -> Tuple[str, Any]:
        for suffix in set(self.once) | set(self.always):
            if path.endswith(suffix):
                queued = self.once.get(suffix)
                if queued:
                    return suffix, queued.pop(0)
                if self.always.get(suffix) is not None:
                    return suffix, self.always[suffix]
                return suffix, None
        return path, None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = [line for line in lines[1:] if line]
            length = 0
            for line in headers:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            which, fault = self._fault(path)
            self.seen[(which, fault if fault is not None else "pass")] += 1
            if fault == "drop":
                return
            if fault is not None:
                payload = b'{"error":"injected","message":"a fault injected by the test proxy"}'
                writer.write(
                    b"HTTP/1.1 %d Injected\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (int(fault), len(payload), payload)
                )
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            kept = [h for h in headers if h.split(":", 1)[0].strip().lower() != "connection"]
            up_writer.write("\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1") + body)
            await up_writer.drain()
            answer = await up_reader.read()
            up_writer.close()
            top, sep, rest = answer.partition(b"\r\n\r\n")
            top_lines = [l for l in top.split(b"\r\n") if not l.lower().startswith(b"connection:")]
            writer.write(b"\r\n".join(top_lines) + b"\r\nConnection: close" + sep + rest)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError, ValueError):
            pass
        finally:
            writer.close()

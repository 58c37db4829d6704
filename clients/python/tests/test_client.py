"""BatonClient against a real ``baton serve``: submit, get, wait, cancel, errors."""

from __future__ import annotations

import asyncio
import time

import baton_client._client as client_module
import httpx
import pytest
from baton_client import (
    BadRequestError,
    BatonClient,
    BatonConnectionError,
    BatonError,
    CommandStatus,
    ConflictError,
    LeaseLostError,
    NotFoundError,
)
from support import BatonServer, client, free_port, run


def test_submit_then_idempotent_resubmit(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            first = await c.submit("jobs", "resize", {"image": "a.png", "width": 640}, id="job-1")
            assert first.created is True
            assert first.id == "job-1"
            assert first.queue == "jobs"
            assert first.type == "resize"
            assert first.params == {"image": "a.png", "width": 640}
            assert first.status is CommandStatus.SUBMITTED
            assert first.result is None and first.error is None
            assert first.attempts == 0 and first.version == 1
            assert first.terminal is False
            assert first.created_at is not None and first.created_at.tzinfo is not None
            assert first.raw["id"] == "job-1"

            # The same id, type and params (another key order): 200, the stored state.
            again = await c.submit("jobs", "resize", {"width": 640, "image": "a.png"}, id="job-1")
            assert again.created is False
            assert again.created_at == first.created_at
            assert again.version == 1

            # Without an id the server makes one; without params they are null.
            anon = await c.submit("jobs", "noop")
            assert anon.created is True and anon.id and anon.id != "job-1"
            assert anon.params is None

            # Same id, other params: 409 conflict.
            with pytest.raises(ConflictError) as info:
                await c.submit("jobs", "resize", {"image": "b.png"}, id="job-1")
            assert info.value.status == 409
            assert info.value.code == "conflict"
            assert "job-1" in info.value.message

    run(main())


def test_submit_with_priority(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            high = await c.submit("jobs", "resize", {"image": "p.png"}, priority=7)
            assert high.priority == 7 and high.raw["priority"] == 7
            plain = await c.submit("jobs", "resize", {"image": "q.png"})
            assert plain.priority == 0 and "priority" not in plain.raw
            with pytest.raises(BadRequestError) as info:
                await c.submit("jobs", "resize", {"image": "r.png"}, priority=11)
            assert info.value.code == "invalid_body"
            assert info.value.message == '"priority" must be an integer from -10 to 10; got 11'

    run(main())


def test_submit_with_concurrency_key(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            keyed = await c.submit("jobs", "resize", {"image": "k.png"}, id="ck-1", concurrency_key="tenant-7")
            assert (keyed.created, keyed.concurrency_key, keyed.raw["concurrency_key"]) == (True, "tenant-7", "tenant-7")
            got = await c.get("ck-1")
            assert got.concurrency_key == "tenant-7"
            # 256 bytes of UTF-8 (128 two-byte characters) is the longest key.
            longest = await c.submit("jobs", "resize", id="ck-2", concurrency_key="é" * 128)
            assert longest.concurrency_key == "é" * 128
            plain = await c.submit("jobs", "resize", {"image": "q.png"})
            assert plain.concurrency_key is None and "concurrency_key" not in plain.raw
            for key, got_bytes in (("", 0), ("k" * 257, 257), ("é" * 129, 258)):
                with pytest.raises(BadRequestError) as info:
                    await c.submit("jobs", "resize", id="ck-bad", concurrency_key=key)
                assert (info.value.status, info.value.code) == (400, "invalid_body")
                assert info.value.message == (
                    f'"concurrency_key" must be 1 to 256 bytes without control characters; got {got_bytes} bytes'
                )
            with pytest.raises(NotFoundError):
                await c.get("ck-bad")

    run(main())


def test_get(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            submitted = await c.submit("jobs", "t", [1, 2.5, "x", None, {"k": True}], id="g-1")
            got = await c.get("g-1")
            assert got == submitted  # every modelled field equal
            assert got.params == [1, 2.5, "x", None, {"k": True}]
            assert got.created is None
            with pytest.raises(NotFoundError) as info:
                await c.get("no-such-command")
            assert (info.value.status, info.value.code) == (404, "not_found")

    run(main())


def test_errors(server: BatonServer) -> None:
    async def main() -> None:
        # On a connection of its own: the server answers this 404 without reading the request
        # body, and the unread body can break the connection's next request (reported).
        async with client(server) as c:
            with pytest.raises(NotFoundError) as nf:
                await c.submit("nope", "t")
            assert nf.value.status == 404
            assert nf.value.code == "unknown_queue"
            assert "jobs" in nf.value.message  # it lists the configured queues
            assert isinstance(nf.value, BatonError)

        async with client(server) as c:
            with pytest.raises(BadRequestError) as bad:
                await c.submit("jobs", "t", id="")
            assert bad.value.status == 400
            assert bad.value.code == "invalid_id"

            with pytest.raises(NotFoundError) as nf2:
                await c.cancel("no-such-command")
            assert nf2.value.code == "not_found"

            # A settlement with a lease that is not ours any more: 409 lease_lost.
            await c.submit("jobs", "t", id="lease-1")
            claimed = await c.request("POST", "/v1/queues/jobs/workers/w1/claim", {"max": 1})
            lease = claimed["leases"][0]["lease"]
            settle = {"lease": lease, "outcome": "succeeded", "result": 1}
            assert (await c.request("POST", "/v1/queues/jobs/workers/w1/settle", settle))["applied"] is True
            with pytest.raises(LeaseLostError) as lost:
                await c.request("POST", "/v1/queues/jobs/workers/w1/settle", settle)
            assert (lost.value.status, lost.value.code) == (409, "lease_lost")
            assert isinstance(lost.value, ConflictError)

        # Nothing listening: a BatonConnectionError, status None.
        async with BatonClient(f"http://127.0.0.1:{free_port()}", timeout=2) as dead:
            with pytest.raises(BatonConnectionError) as conn:
                await dead.get("x")
            assert conn.value.status is None and conn.value.code == "connection_error"

    run(main())


def test_wait_times_out_with_the_latest_state(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="w-1")
            start = time.monotonic()
            state = await c.wait("w-1", timeout=1.0)
            elapsed = time.monotonic() - start
            assert state.status is CommandStatus.SUBMITTED
            assert 0.95 <= elapsed < 2.5, elapsed

    run(main())


def test_wait_returns_when_terminal(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="w-2")
            start = time.monotonic()
            waiter = asyncio.ensure_future(c.wait("w-2", timeout=30))
            await asyncio.sleep(0.3)
            await c.cancel("w-2")
            state = await waiter
            assert state.status is CommandStatus.CANCELLED
            assert state.terminal
            assert time.monotonic() - start < 3.0  # not the 30 s timeout

            # Already terminal: at once.
            start = time.monotonic()
            assert (await c.wait("w-2", timeout=30)).status is CommandStatus.CANCELLED
            assert time.monotonic() - start < 1.0

    run(main())


def test_wait_long_polls_in_chunks(server: BatonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait longer than the server's 5 m maximum is split into several requests
    (the maximum is lowered to 0.3 s here to see it)."""
    monkeypatch.setattr(client_module, "MAX_WAIT", 0.3)
    waits = []

    async def on_request(request: httpx.Request) -> None:
        if "wait" in request.url.params:
            waits.append(request.url.params["wait"])

    async def main() -> None:
        async with httpx.AsyncClient(event_hooks={"request": [on_request]}) as http:
            c = BatonClient(server.url, http_client=http)
            await c.submit("jobs", "t", id="w-3")
            start = time.monotonic()
            state = await c.wait("w-3", timeout=1.0)
            assert state.status is CommandStatus.SUBMITTED
            assert time.monotonic() - start >= 0.95
        assert len(waits) >= 3, waits
        assert waits[0] == "300ms"
        assert all(int(w[:-2]) <= 300 for w in waits), waits

    run(main())


def test_cancel(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="c-1")
            cancelled = await c.cancel("c-1")
            assert cancelled.status is CommandStatus.CANCELLED
            assert cancelled.completed_at is not None
            # Already terminal: the unchanged state comes back (no exception).
            again = await c.cancel("c-1")
            assert again.status is CommandStatus.CANCELLED
            assert again.version == cancelled.version
            assert again.modified_at == cancelled.modified_at

            # A command that succeeded stays SUCCEEDED, with its result.
            await c.submit("jobs", "t", id="c-2")
            claimed = await c.request("POST", "/v1/queues/jobs/workers/w1/claim", {"max": 1})
            lease = claimed["leases"][0]["lease"]
            await c.request(
                "POST", "/v1/queues/jobs/workers/w1/settle", {"lease": lease, "outcome": "succeeded", "result": "r"}
            )
            done = await c.cancel("c-2")
            assert done.status is CommandStatus.SUCCEEDED
            assert done.result == "r"

    run(main())


def test_submit_with_wait(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            start = time.monotonic()
            state = await c.submit("jobs", "t", id="sw-1", wait=0.5)
            assert state.created is True
            assert state.status is CommandStatus.SUBMITTED
            assert 0.45 <= time.monotonic() - start < 2.0

    run(main())

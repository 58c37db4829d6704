"""Bearer tokens: the client and the worker send them; refusals are AuthError."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from baton_client import AuthError, BatonClient, CommandStatus, Job, Worker
from support import CONFIG, BatonServer, RedisServer, run, running, start_baton, stop_process

CLIENT_TOKEN = "client-token-0123456789"
WORK_TOKEN = "worker-token-0123456789"

AUTH_CONFIG = (
    CONFIG
    + f"""
[[tokens]]
name = "client"
token = "{CLIENT_TOKEN}"
operations = ["read", "write"]
queues = ["jobs"]

[[tokens]]
name = "worker"
token = "{WORK_TOKEN}"
operations = ["work"]
queues = ["jobs"]
"""
)


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[BatonServer]:
    """Memory backend only: tokens do not depend on the backend."""
    redis: Optional[RedisServer] = None
    srv = start_baton(tmp_path, "memory", redis, config=AUTH_CONFIG)
    try:
        yield srv
    finally:
        stop_process(srv.proc, graceful=False)


def test_tokens_are_sent_and_refusals_raise_auth_error(auth_server: BatonServer) -> None:
    def handler(job: Job) -> Any:
        return {"ok": True}

    async def main() -> None:
        async with BatonClient(auth_server.url) as anonymous:
            with pytest.raises(AuthError) as missing:
                await anonymous.get("x")
            assert missing.value.status == 401
        async with BatonClient(auth_server.url, token=WORK_TOKEN) as wrong:
            with pytest.raises(AuthError) as forbidden:  # a work token cannot submit
                await wrong.submit("jobs", "t")
            assert forbidden.value.status == 403
            assert forbidden.value.code == "forbidden"

        async with BatonClient(auth_server.url, token=CLIENT_TOKEN) as c:
            await c.submit("jobs", "t", id="auth-1")
            worker = Worker(auth_server.url, "jobs", handler, token=WORK_TOKEN, claim_wait="1s")
            async with running(worker):
                state = await c.wait("auth-1", timeout=10)
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"ok": True}

        # A worker whose token may not work on the queue stops with the error.
        refused = Worker(auth_server.url, "jobs", handler, token=CLIENT_TOKEN)
        with pytest.raises(AuthError) as info:
            await refused.run()
        assert info.value.status == 403

    run(main())


def test_worker_renews_with_its_token(auth_server: BatonServer, caplog: pytest.LogCaptureFixture) -> None:
    """The lease renewal process sends the worker's token too: a handler running 2.5× the claim
    timeout keeps its lease (no renewal refused; the worker's free second slot never gets the
    command again) and is settled once."""
    import asyncio
    import logging
    import time

    from support import CLAIM_TIMEOUT

    calls = []

    def handler(job: Job) -> Any:
        calls.append(job.deliveries)
        time.sleep(2.5 * CLAIM_TIMEOUT)
        return {"ok": True}

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        async with BatonClient(auth_server.url, token=CLIENT_TOKEN) as c:
            await c.submit("jobs", "t", id="auth-renew-1")
            worker = Worker(auth_server.url, "jobs", handler, token=WORK_TOKEN, concurrency=2, claim_wait="1s")
            async with running(worker):
                state = await c.wait("auth-renew-1", timeout=15)
                await asyncio.sleep(0.2)
            assert state.status is CommandStatus.SUCCEEDED
            assert state.attempts == 1
            assert calls == [1]
            failed = [r.getMessage() for r in caplog.records if "renewing" in r.getMessage()]
            assert failed == []

    run(main())

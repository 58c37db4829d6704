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

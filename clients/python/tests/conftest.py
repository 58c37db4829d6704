"""Fixtures: a fresh ``baton serve`` per test, on the memory backend and on Redis."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, List

import pytest
from support import BatonServer, RedisServer, start_baton, stop_process


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


def _backends() -> List[str]:
    wanted = os.environ.get("BATON_TEST_BACKENDS", "memory,redis")
    return [b.strip() for b in wanted.split(",") if b.strip()]


@pytest.fixture(params=_backends())
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatonServer]:
    """A fresh ``baton serve --no-workers`` with queues ``jobs`` and ``other`` (claim timeout 1 s)."""
    backend = request.param
    redis = request.getfixturevalue("redis_server") if backend == "redis" else None
    srv = start_baton(tmp_path, backend, redis)
    try:
        yield srv
    finally:
        stop_process(srv.proc, graceful=False)  # a test server's state is thrown away



"""Fixtures: a fresh ``baton serve`` per test, on the memory backend and on Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from support import BatonServer, RedisServer, backends, start_baton, stop_process


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_only(request: pytest.FixtureRequest) -> RedisServer:
    """The session's redis-server, for a test of the Redis backend only (skipped without it)."""
    if "redis" not in backends():
        pytest.skip("the Redis backend is not tested (BATON_TEST_BACKENDS)")
    server: RedisServer = request.getfixturevalue("redis_server")
    return server


@pytest.fixture
def memory_server(tmp_path: Path) -> Iterator[BatonServer]:
    """As ``server``, on the memory backend only: for tests of the SDK's own behaviour, which
    does not depend on the backend."""
    srv = start_baton(tmp_path, "memory", None)
    try:
        yield srv
    finally:
        stop_process(srv.proc, graceful=False)


@pytest.fixture(params=backends())
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatonServer]:
    """A fresh ``baton serve --no-workers`` with queues ``jobs`` and ``other`` (claim timeout 1 s)
    and ``slow`` (2 s)."""
    backend = request.param
    redis = request.getfixturevalue("redis_server") if backend == "redis" else None
    srv = start_baton(tmp_path, backend, redis)
    try:
        yield srv
    finally:
        stop_process(srv.proc, graceful=False)  # a test server's state is thrown away



"""BatonClient.submit_many against a real ``baton serve``: per-item outcomes in order, splitting
over 1000 items, whole-request errors, and the created commands run by a worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, List

import httpx
import pytest
from baton_client import (
    MAX_BATCH,
    BadRequestError,
    BatonClient,
    BatonError,
    CommandState,
    CommandStatus,
    ConflictError,
    Job,
    NotFoundError,
    Worker,
)
from support import CONFIG, BatonServer, backends, client, run, running, start_baton, stop_process

# Queue "batch" has the built-in echo handler configured: the server knows its types and answers
# an item of another type 400 unknown_type. The server runs with --no-workers, so the SDK's
# Worker below runs the commands.
BATCH_CONFIG = (
    CONFIG
    + """
[queues.batch]
claim_timeout = "1s"

[queues.batch.handlers]
echo = "echo"
"""
)


@pytest.fixture(params=backends())
def batch_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatonServer]:
    """As ``server``, with the queue ``batch`` (type ``echo`` only) too."""
    backend = request.param
    redis = request.getfixturevalue("redis_server") if backend == "redis" else None
    srv = start_baton(tmp_path, backend, redis, config=BATCH_CONFIG)
    try:
        yield srv
    finally:
        stop_process(srv.proc, graceful=False)


class Requests:
    """Counts the batch requests a client sends and the number of commands in each."""

    def __init__(self) -> None:
        self.sizes: List[int] = []

    async def hook(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/commands/batch"):
            self.sizes.append(len(json.loads(request.content)["commands"]))


def test_submit_many_mixed_batch_in_order_then_run(batch_server: BatonServer) -> None:
    def echo(job: Job) -> Any:
        return {"echo": job.params}

    async def main() -> None:
        async with client(batch_server) as c:
            pre = await c.submit("batch", "echo", {"n": "pre"}, id="b-pre")
            assert pre.created is True
            out = await c.submit_many(
                "batch",
                [
                    {"type": "echo", "params": {"n": 0}, "id": "b-0"},  # new
                    {"type": "echo", "params": {"n": 1}},  # new, the server makes the id
                    {"type": "echo", "params": {"n": 0}, "id": "b-0"},  # same id and body again: 200
                    {"type": "echo", "params": {"n": 99}, "id": "b-0"},  # same id, other params: 409
                    {"type": "resize", "params": {"n": 4}, "id": "b-4"},  # no such type here: 400
                    {"type": "echo", "params": {"n": 5}, "id": "b-5", "priority": 3},  # new
                    {"type": "echo", "params": {"n": "pre"}, "id": "b-pre"},  # stored before: 200
                    {"type": "echo", "id": "b-7", "priority": 11},  # out of range: 400
                ],
            )
            assert len(out) == 8

            first = out[0]
            assert isinstance(first, CommandState)
            assert (first.created, first.id, first.queue, first.type) == (True, "b-0", "batch", "echo")
            assert (first.params, first.status, first.version) == ({"n": 0}, CommandStatus.SUBMITTED, 1)

            anon = out[1]
            assert isinstance(anon, CommandState)
            assert anon.created is True and anon.params == {"n": 1}
            assert anon.id not in ("", "b-0", "b-4", "b-5", "b-pre")

            again = out[2]
            assert isinstance(again, CommandState)
            assert (again.created, again.id, again.created_at) == (False, "b-0", first.created_at)

            conflict = out[3]
            assert isinstance(conflict, ConflictError), conflict
            assert (conflict.status, conflict.code) == (409, "conflict")
            assert "b-0" in conflict.message
            assert conflict.body is not None and conflict.body["error"] == "conflict"

            unknown = out[4]
            assert isinstance(unknown, BadRequestError), unknown
            assert (unknown.status, unknown.code) == (400, "unknown_type")
            assert "echo" in unknown.message  # it names the types the queue has

            fifth = out[5]
            assert isinstance(fifth, CommandState)
            assert (fifth.created, fifth.id, fifth.priority, fifth.params) == (True, "b-5", 3, {"n": 5})

            stored = out[6]
            assert isinstance(stored, CommandState)
            assert (stored.created, stored.id, stored.created_at) == (False, "b-pre", pre.created_at)

            bad = out[7]
            assert isinstance(bad, BadRequestError), bad
            assert (bad.status, bad.code) == (400, "invalid_body")
            assert bad.message == '"priority" must be an integer from -10 to 10; got 11'

            # The refused items stored nothing; the stored ones kept their first params.
            for refused in ("b-4", "b-7"):
                with pytest.raises(NotFoundError):
                    await c.get(refused)
            assert (await c.get("b-0")).params == {"n": 0}

            created = {"b-pre": {"n": "pre"}, "b-0": {"n": 0}, anon.id: {"n": 1}, "b-5": {"n": 5}}
            worker = Worker(batch_server.url, "batch", {"echo": echo}, claim_wait="2s", shutdown_grace=2.0)
            async with running(worker):
                for id, params in created.items():
                    done = await c.wait(id, timeout=15)
                    assert done.status is CommandStatus.SUCCEEDED, (id, done.status, done.error)
                    assert done.result == {"echo": params}
                    assert done.attempts == 1

    run(main())


def test_submit_many_splits_over_1000_items(server: BatonServer) -> None:
    count = 1500
    items = [{"type": "t", "params": {"i": i}, "id": f"s-{i}"} for i in range(count)]
    seen = Requests()

    async def main() -> None:
        async with httpx.AsyncClient(event_hooks={"request": [seen.hook]}, timeout=60) as http:
            c = BatonClient(server.url, http_client=http)
            out = await c.submit_many("jobs", items)
            assert seen.sizes == [MAX_BATCH, count - MAX_BATCH] == [1000, 500]
            assert len(out) == count
            for i, state in enumerate(out):
                assert isinstance(state, CommandState), (i, state)
                assert (state.created, state.id, state.params) == (True, f"s-{i}", {"i": i})

            # Again: every one already stored (200), still in order across the two requests.
            again = await c.submit_many("jobs", items)
            assert seen.sizes == [1000, 500, 1000, 500]
            for i, state in enumerate(again):
                assert isinstance(state, CommandState), (i, state)
                assert (state.created, state.id, state.created_at) == (False, f"s-{i}", out[i].created_at)

            # An error in the second request comes back at its place in the whole list.
            items[1200] = {"type": "t", "params": {"i": "other"}, "id": "s-1200"}
            mixed = await c.submit_many("jobs", items)
            assert [i for i, o in enumerate(mixed) if isinstance(o, BatonError)] == [1200]
            assert isinstance(mixed[1200], ConflictError) and mixed[1200].code == "conflict"

    run(main(), timeout=120)


def test_submit_many_with_concurrency_keys(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            out = await c.submit_many(
                "jobs",
                [
                    {"type": "t", "id": "bk-1", "concurrency_key": "tenant-a"},
                    {"type": "t", "id": "bk-2", "concurrency_key": ""},  # 400 in place
                    {"type": "t", "id": "bk-3"},
                    {"type": "t", "id": "bk-4", "concurrency_key": "k" * 257},  # 400 in place
                    {"type": "t", "id": "bk-5", "concurrency_key": "tenant-a", "priority": 2},
                ],
            )
            assert len(out) == 5
            first, empty, plain, too_long, fifth = out
            assert isinstance(first, CommandState) and isinstance(plain, CommandState)
            assert isinstance(fifth, CommandState)
            assert (first.created, first.id, first.concurrency_key) == (True, "bk-1", "tenant-a")
            assert first.raw["concurrency_key"] == "tenant-a"
            assert (plain.id, plain.concurrency_key) == ("bk-3", None) and "concurrency_key" not in plain.raw
            assert (fifth.id, fifth.concurrency_key, fifth.priority) == ("bk-5", "tenant-a", 2)
            for bad, got_bytes in ((empty, 0), (too_long, 257)):
                assert isinstance(bad, BadRequestError), bad
                assert (bad.status, bad.code) == (400, "invalid_body")
                assert bad.message == (
                    f'"concurrency_key" must be 1 to 256 bytes without control characters; got {got_bytes} bytes'
                )
            assert (await c.get("bk-5")).concurrency_key == "tenant-a"
            for missing in ("bk-2", "bk-4"):
                with pytest.raises(NotFoundError):
                    await c.get(missing)

    run(main())


def test_submit_many_empty_and_refused_items_send_nothing(memory_server: BatonServer) -> None:
    seen = Requests()

    async def main() -> None:
        async with httpx.AsyncClient(event_hooks={"request": [seen.hook]}) as http:
            c = BatonClient(memory_server.url, http_client=http)
            assert await c.submit_many("jobs", []) == []

            with pytest.raises(ValueError) as typo:
                await c.submit_many("jobs", [{"type": "t"}, {"type": "t", "prams": {}}])
            assert str(typo.value) == (
                "items[1] has unknown key(s) prams; an item has only type, params, id, output, run_at, delay, "
                "concurrency_key, priority"
            )
            with pytest.raises(ValueError) as both:
                await c.submit_many("jobs", [{"type": "t", "run_at": "2030-01-01T00:00:00Z", "delay": 5}])
            assert str(both.value) == "items[0]: give run_at or delay, not both"
            with pytest.raises(TypeError) as untyped:
                await c.submit_many("jobs", [{"type": "t"}, {"type": "t"}, {"params": 1}])
            assert str(untyped.value) == "items[2] needs a string 'type', got None"
            with pytest.raises(TypeError) as unjson:
                await c.submit_many("jobs", [{"type": "t", "params": {1, 2}}])
            assert str(unjson.value).startswith("items[0]: Object of type set is not JSON serializable")
            assert seen.sizes == []

    run(main())


def test_submit_many_whole_request_errors_raise(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            with pytest.raises(NotFoundError) as nf:
                await c.submit_many("nope", [{"type": "t", "id": "x-1"}])
            assert (nf.value.status, nf.value.code) == (404, "unknown_queue")
            assert "jobs" in nf.value.message
        async with client(server) as c:
            with pytest.raises(NotFoundError):
                await c.get("x-1")

    run(main())

"""Progress and checkpoints (``job.progress``, ``job.checkpoint``, ``job.report``, ``job.details``)
against a real ``baton serve``: written with the lease renewals, kept in the final state, handed
to the next delivery; a bad report raises in the handler and never reaches a renewal."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
from baton_client import CommandStatus, Job, Progress, RawJSON, Release, Worker
from support import CLAIM_TIMEOUT, SLOW_CLAIM_TIMEOUT, BatonServer, client, run, running, wait_until

SLOW_INTERVAL = SLOW_CLAIM_TIMEOUT / 3  # the renewal interval on queue "slow"


def make_worker(server: BatonServer, handler: Any, queue: str = "jobs", **kwargs: Any) -> Worker:
    kwargs.setdefault("claim_wait", "2s")
    kwargs.setdefault("shutdown_grace", 2.0)
    return Worker(server.url, queue, handler, **kwargs)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_progress_and_checkpoint_go_with_the_next_renewal_and_stay(server: BatonServer, kind: str) -> None:
    go = threading.Event()
    seen: List[Any] = []

    def report(job: Job) -> None:
        seen.append(job.details)
        job.progress(0.5, "half way")
        job.checkpoint({"step": 1, "text": "é ✓"})

    def plain(job: Job) -> Any:
        report(job)
        assert go.wait(10)
        return {"done": True}

    async def coro(job: Job) -> Any:
        report(job)
        for _ in range(1000):
            if go.is_set():
                break
            await asyncio.sleep(0.01)
        return {"done": True}

    async def main() -> None:
        async with client(server) as c:
            submitted = await c.submit("slow", "t", {"n": 1}, id="p-1")
            assert submitted.progress is None and submitted.details is None
            async with running(make_worker(server, plain if kind == "sync" else coro, queue="slow")):
                # Written with the lease's next renewal: within one interval of the report.
                await wait_until(lambda: seen, timeout=5)
                reported_at = time.monotonic()
                state = await c.get("p-1")
                while state.progress is None and time.monotonic() - reported_at < 1.5 * SLOW_INTERVAL:
                    await asyncio.sleep(0.02)
                    state = await c.get("p-1")
                assert state.status is CommandStatus.SUBMITTED
                assert state.progress == Progress(fraction=0.5, message="half way")
                assert state.details == {"step": 1, "text": "é ✓"}
                assert state.raw["progress"] == {"fraction": 0.5, "message": "half way"}
                # A written report is done: the renewals after it write nothing more.
                await asyncio.sleep(1.5 * SLOW_INTERVAL)
                again = await c.get("p-1")
                assert again.version == state.version
                assert again.progress == state.progress and again.details == state.details
                go.set()
                final = await c.wait("p-1", timeout=10)
            assert final.status is CommandStatus.SUCCEEDED and final.result == {"done": True}
            assert final.progress == Progress(fraction=0.5, message="half way")
            assert final.details == {"step": 1, "text": "é ✓"}
            assert final.version == state.version + 1  # the settlement only
            assert seen == [None]

    run(main(), timeout=30)


def test_report_made_just_before_returning_is_written_before_the_settlement(server: BatonServer) -> None:
    """The last report has not gone out when the handler returns: the worker sends it first."""

    def handler(job: Job) -> Any:
        job.progress(0.25)
        job.report(progress={"fraction": 1, "message": "all done"}, details=RawJSON('{"n":18446744073709551615}'))
        return "ok"

    async def main() -> None:
        async with client(server) as c:
            await c.submit("slow", "t", id="p-2")
            async with running(make_worker(server, handler, queue="slow")):
                final = await c.wait("p-2", timeout=10)
        assert final.status is CommandStatus.SUCCEEDED and final.result == "ok"
        assert final.progress == Progress(fraction=1.0, message="all done")
        assert final.details == {"n": 18446744073709551615}

    run(main(), timeout=20)


def test_checkpoint_resumes_after_a_retried_error_and_a_release(server: BatonServer) -> None:
    """An error (retried by the server) and a ``Release`` hand the last checkpoint to the next
    delivery as ``job.details``; progress reported later merges with it."""
    seen: List[Tuple[int, Any]] = []

    def handler(job: Job) -> Any:
        seen.append((job.deliveries, job.details))
        step = (job.details or {}).get("step", 0)
        if step == 0:
            job.checkpoint({"step": 1})
            job.checkpoint({"step": 2})  # the latest unsent one wins
            raise RuntimeError("boom")
        if step == 2:
            job.report(progress={"message": "releasing"}, details={"step": 3})
            return Release()
        job.progress(fraction=1.0)
        return {"resumed_from": step}

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="p-3")
            async with running(make_worker(server, handler)):
                final = await c.wait("p-3", timeout=15)
        assert final.status is CommandStatus.SUCCEEDED, final
        assert final.result == {"resumed_from": 3}
        assert [d for _, d in seen] == [None, {"step": 2}, {"step": 3}]
        assert final.details == {"step": 3}
        assert final.progress == Progress(fraction=1.0, message=None)

    run(main(), timeout=30)


def test_checkpoint_resumes_on_another_worker_after_a_stop(server: BatonServer) -> None:
    """A stopping worker releases its unfinished job: the checkpoint made just before the stop
    goes out first, and the next worker resumes from it."""
    started = threading.Event()
    seen: List[Any] = []

    def first(job: Job) -> Any:
        seen.append(job.details)
        started.set()
        job.cancelled.wait(30)
        job.checkpoint({"step": 2})  # after the shutdown signal: flushed before the release
        job.raise_if_cancelled()
        return "not reached"

    def second(job: Job) -> Any:
        seen.append(job.details)
        return {"resumed_from": job.details}

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="p-4")
            async with running(make_worker(server, first, shutdown_grace=0.2, cancel_grace=2.0)):
                await wait_until(started.is_set, timeout=5)
            async with running(make_worker(server, second)):
                final = await c.wait("p-4", timeout=10)
        assert final.status is CommandStatus.SUCCEEDED
        assert seen == [None, {"step": 2}]
        assert final.result == {"resumed_from": {"step": 2}}

    run(main(), timeout=30)


_BAD: List[Tuple[str, Callable[[Job], None], type]] = [
    ("nothing", lambda j: j.progress(), TypeError),
    ("fraction > 1", lambda j: j.progress(1.5), ValueError),
    ("fraction < 0", lambda j: j.progress(-0.1), ValueError),
    ("fraction NaN", lambda j: j.progress(math.nan), ValueError),
    ("fraction inf", lambda j: j.progress(math.inf), ValueError),
    ("fraction bool", lambda j: j.progress(True), TypeError),
    ("fraction str", lambda j: j.progress("0.5"), TypeError),  # type: ignore[arg-type]
    ("message long", lambda j: j.progress(message="x" * 1025), ValueError),
    ("message long utf-8", lambda j: j.progress(message="é" * 513), ValueError),
    ("message surrogate", lambda j: j.progress(message="a\ud800"), ValueError),
    ("message int", lambda j: j.progress(message=5), TypeError),  # type: ignore[arg-type]
    ("details None", lambda j: j.checkpoint(None), TypeError),
    ("details object", lambda j: j.checkpoint({"x": object()}), TypeError),
    ("details NaN", lambda j: j.checkpoint({"x": math.nan}), ValueError),
    ("details inf", lambda j: j.checkpoint([math.inf]), ValueError),
    ("details large", lambda j: j.checkpoint("x" * (64 * 1024 - 1)), ValueError),
    ("details surrogate", lambda j: j.checkpoint({"k": "\udc00"}), ValueError),
    ("details raw null", lambda j: j.checkpoint(RawJSON("null")), TypeError),
    ("report empty", lambda j: j.report(), TypeError),
    ("report progress number", lambda j: j.report(progress=0.5), TypeError),
    ("report progress field", lambda j: j.report(progress={"fraction": 0.5, "eta": 3}), TypeError),
    ("report bad part", lambda j: j.report(progress={"fraction": 2}, details={"ok": 1}), ValueError),
]


def test_bad_reports_raise_in_the_handler_and_other_leases_keep_renewing(server: BatonServer) -> None:
    """Every bad report raises at the call; none reaches a renewal (which the server would refuse
    whole): both jobs hold their leases well past the claim timeout, and the largest reports the
    server keeps are written."""
    errors: Dict[str, Optional[str]] = {}
    biggest_message = "é" * 512  # 1024 bytes of UTF-8
    biggest_details = "x" * (64 * 1024 - 2)  # 64 KiB of JSON with its quotes
    deliveries: List[Tuple[Any, int]] = []

    def handler(job: Job) -> Any:
        deliveries.append((job.params, job.deliveries))
        if job.params == "bad":
            circular: List[Any] = []
            circular.append(circular)
            cases = _BAD + [("details circular", lambda j: j.checkpoint(circular), ValueError)]
            for name, call, want in cases:
                try:
                    call(job)
                except want as exc:
                    assert str(exc).startswith("job."), exc
                    errors[name] = None
                except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                    errors[name] = f"{type(exc).__name__}: {exc}"
                else:
                    errors[name] = "did not raise"
            job.progress(message=biggest_message)
            job.checkpoint(biggest_details)
        else:
            job.progress(0, "other")
            job.checkpoint({"other": True})
        time.sleep(2.5 * CLAIM_TIMEOUT)  # renewed several times meanwhile
        return job.params

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", "bad", id="p-bad")
            await c.submit("jobs", "t", "good", id="p-good")
            async with running(make_worker(server, handler, concurrency=2)):
                bad = await c.wait("p-bad", timeout=15)
                good = await c.wait("p-good", timeout=15)
        assert {k: v for k, v in errors.items() if v is not None} == {}
        assert len(errors) == len(_BAD) + 1
        assert sorted(deliveries) == [("bad", 1), ("good", 1)]
        for state, result in ((bad, "bad"), (good, "good")):
            assert state.status is CommandStatus.SUCCEEDED and state.result == result
            assert state.attempts == 1 and state.errors_count == 0  # never taken over
        assert bad.progress == Progress(fraction=None, message=biggest_message)
        assert bad.details == biggest_details
        assert good.progress == Progress(fraction=0.0, message="other")
        assert good.details == {"other": True}

    run(main(), timeout=30)


def test_a_command_with_an_output_stream_is_written_by_its_job(server: BatonServer) -> None:
    """``submit(output=True)`` links the stream in the state; the claimed job gets it opened for
    its delivery (``job.output``) and appends with its producer headers; the settlement ends it."""
    import httpx

    seen: List[Any] = []

    async def handler(job: Job) -> Any:
        assert job.output is not None
        seen.append((job.output.stream, job.output.url, job.output.content_type, job.output.producer_id))
        async with httpx.AsyncClient(base_url=server.url) as h:
            for seq, line in enumerate(["one", "two"]):
                r = await h.post(job.output.url, content=f'{{"line":"{line}"}}', headers=job.output.headers(seq))
                assert r.status_code == 200, r.text
        return "written"

    async def main() -> None:
        async with client(server) as c:
            submitted = await c.submit("jobs", "t", id="out-1", output=True)
            assert submitted.output is not None
            assert (submitted.output.stream, submitted.output.url, submitted.output.run) == (
                "commands/out-1",
                "/v1/stream/commands/out-1",
                1,
            )
            assert (submitted.output.content_type, submitted.output.silence_timeout_ms) == ("application/json", None)
            plain = await c.submit("jobs", "t", id="out-2")
            assert plain.output is None
            async with running(make_worker(server, handler)):
                final = await c.wait("out-1", timeout=10)
                await c.wait("out-2", timeout=10)
            assert final.status is CommandStatus.SUCCEEDED and final.result == "written"
            assert final.output == submitted.output
            assert seen == [("commands/out-1", "/v1/stream/commands/out-1", "application/json", "command")]
            async with httpx.AsyncClient(base_url=server.url) as h:
                r = await h.get("/v1/stream/commands/out-1", params={"offset": "-1"})
            assert r.json() == [{"line": "one"}, {"line": "two"}]
            assert r.headers.get("stream-closed") == "true"
            custom = await c.submit(
                "jobs", "t", id="out-3", output={"path": "team/out-3", "content_type": "text/plain", "silence_timeout": "90s"}
            )
            assert custom.output is not None
            assert (custom.output.stream, custom.output.content_type, custom.output.silence_timeout_ms) == (
                "team/out-3",
                "text/plain",
                90000,
            )

    run(main(), timeout=30)

"""Worker against a real ``baton serve`` (claim timeout 1 s): outcomes, leases that hold
whatever the handler does, crashes, cancellation, shutdown, concurrency."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Tuple

import httpx
import pytest
from baton_client import (
    CancelReason,
    CommandStatus,
    Failed,
    HandOff,
    Job,
    NotFoundError,
    RawJSON,
    Release,
    Running,
    Worker,
)
from support import (
    CLAIM_TIMEOUT,
    SLOW_CLAIM_TIMEOUT,
    BatonServer,
    FaultProxy,
    RedisServer,
    client,
    run,
    running,
    start_baton,
    stop_process,
    wait_until,
)

HERE = Path(__file__).resolve().parent


def make_worker(server: BatonServer, handler: Any, queue: str = "jobs", **kwargs: Any) -> Worker:
    kwargs.setdefault("claim_wait", "2s")
    kwargs.setdefault("shutdown_grace", 2.0)
    return Worker(server.url, queue, handler, **kwargs)


# --- outcomes ---


def test_result_is_stored_exactly(server: BatonServer) -> None:
    value = {"big": 12345678901234567890, "f": 0.1, "s": "é ✓", "list": [1, None, True, {"k": [2.5]}]}
    raw_text = '{"n":18446744073709551615,"x":1.10,"e":"\\u00e9"}'

    def plain(job: Job) -> Any:
        return value

    async def raw(job: Job) -> Any:
        return RawJSON(raw_text)

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "plain", {"a": 1}, id="r-1")
            await c.submit("jobs", "raw", id="r-2")
            async with running(make_worker(server, {"plain": plain, "raw": raw})):
                s1 = await c.wait("r-1", timeout=10)
                s2 = await c.wait("r-2", timeout=10)
            assert s1.status is CommandStatus.SUCCEEDED
            assert s1.result == value
            assert s1.attempts == 1 and s1.error is None
            assert s2.status is CommandStatus.SUCCEEDED
            text = httpx.get(f"{server.url}/v1/commands/r-2").text
            assert f'"result":{raw_text}' in text  # byte for byte

    run(main())


def test_failed_ends_the_command_failed_with_the_message(server: BatonServer) -> None:
    calls = Counter()

    def handler(job: Job) -> Any:
        calls[job.id] += 1
        raise Failed(f"bad input: {job.params['image']}")

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "resize", {"image": "a.png"}, id="f-1")
            async with running(make_worker(server, handler)):
                state = await c.wait("f-1", timeout=10)
            assert state.status is CommandStatus.FAILED
            assert state.error == "bad input: a.png"
            assert state.result is None
            assert state.attempts == 1
            assert calls == {"f-1": 1}  # not retried

    run(main())


def test_exception_is_retried_by_the_server(server: BatonServer) -> None:
    """Queue ``jobs`` retries errors up to 3 attempts, 100 ms apart."""
    calls: List[Tuple[str, int, int]] = []

    async def handler(job: Job) -> Any:
        calls.append((job.id, job.attempts, job.deliveries))
        if job.id == "e-always" or len([c for c in calls if c[0] == job.id]) < 3:
            raise RuntimeError(f"boom {job.id}")
        return "third time lucky"

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="e-1")
            await c.submit("jobs", "t", id="e-always")
            async with running(make_worker(server, handler)):
                ok = await c.wait("e-1", timeout=15)
                bad = await c.wait("e-always", timeout=15)
            assert ok.status is CommandStatus.SUCCEEDED
            assert ok.result == "third time lucky"
            assert ok.attempts == 3
            assert ok.errors_count == 0
            assert [a for (i, a, _) in calls if i == "e-1"] == [0, 1, 2]
            assert bad.status is CommandStatus.FAILED
            assert bad.error == "RuntimeError: boom e-always"
            assert bad.attempts == 3
            assert bad.errors_count == 3
            assert len([c for c in calls if c[0] == "e-always"]) == 3

    run(main())


def test_running_then_check_status_finishes_it(server: BatonServer) -> None:
    calls: List[Tuple[str, str]] = []

    def handler(job: Job) -> Any:
        calls.append((job.call, str(job.command.status)))
        if job.call == "execute":
            return Running(next_check=0.2)
        return {"checked": True, "params": job.params}

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "long", {"n": 1}, id="cs-1")
            async with running(make_worker(server, handler)):
                await wait_until(lambda: len(calls) >= 1)
                await asyncio.sleep(0.05)
                mid = await c.get("cs-1")
                final = await c.wait("cs-1", timeout=10)
            assert mid.status in (CommandStatus.RUNNING, CommandStatus.SUCCEEDED)
            assert calls == [("execute", "SUBMITTED"), ("check_status", "RUNNING")]
            assert final.status is CommandStatus.SUCCEEDED
            assert final.result == {"checked": True, "params": {"n": 1}}
            assert final.attempts == 1

    run(main())


def test_hand_off_to_a_second_queue(server: BatonServer) -> None:
    seen: List[Tuple[str, str, str]] = []

    async def first(job: Job) -> Any:
        seen.append(("jobs", job.call, str(job.command.status)))
        return HandOff("other")

    def second(job: Job) -> Any:
        seen.append(("other", job.call, str(job.command.status)))
        return {"finished_on": "other"}

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "deploy", id="h-1")
            async with running(make_worker(server, first)), running(make_worker(server, second, queue="other")):
                state = await c.wait("h-1", timeout=10)
            assert seen == [("jobs", "execute", "SUBMITTED"), ("other", "check_status", "RUNNING")]
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"finished_on": "other"}
            assert state.handed_off_to == "other"
            assert state.queue == "jobs"

    run(main())


@pytest.mark.parametrize("target", ["no-such-queue", "jobs"])
def test_hand_off_the_server_refuses_fails_the_command_naming_the_queue(
    server: BatonServer, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-off to a queue the server does not have, or to the command's own queue, is
    refused (400, nothing changed): the worker settles the command FAILED, naming the queue,
    so that it does not come back after every claim timeout."""
    calls: List[int] = []

    def handler(job: Job) -> Any:
        calls.append(job.deliveries)
        return HandOff(target)

    async def main() -> None:
        caplog.set_level(logging.INFO, logger="baton_client.worker")
        async with client(server) as c:
            await c.submit("jobs", "t", id="hb-1")
            async with running(make_worker(server, handler)):
                state = await c.wait("hb-1", timeout=10)
                await asyncio.sleep(1.5 * CLAIM_TIMEOUT)  # no redelivery
            assert state.status is CommandStatus.FAILED
            assert state.handed_off_to is None
            assert state.attempts == 1
            assert f"the handler handed the command off to queue {target!r}, which the server refused" in state.error
            assert calls == [1]
            refused = [r for r in caplog.records if "refused the hand-off" in r.getMessage()]
            assert len(refused) == 1 and refused[0].levelno == logging.ERROR
            assert repr(target) in refused[0].getMessage()

    run(main())


def test_settlements_ready_together_go_in_one_request(
    server: BatonServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Handlers ending at the same moment: their settlements share requests
    (``{"settlements": [...]}``), each applied as if alone; a hand-off the server refuses
    (the whole request, naming the item) fails that command only, the others are sent again."""
    n = 40
    gate = asyncio.Event()
    started: List[str] = []

    async def handler(job: Job) -> Any:
        started.append(job.id)
        if len(started) == n:
            gate.set()
        await gate.wait()
        if job.params["i"] % 10 == 0:
            raise Failed(f"no {job.params['i']}")
        if job.params["i"] == 7:
            return HandOff("no-such-queue")
        return {"i": job.params["i"]}

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        async with client(server) as c:
            ids = [f"bt-{i}" for i in range(n)]
            await asyncio.gather(*(c.submit("jobs", "t", {"i": i}, id=cid) for i, cid in enumerate(ids)))
            async with running(make_worker(server, handler, concurrency=n)):
                states = await asyncio.gather(*(c.wait(cid, timeout=20) for cid in ids))
            for i, state in enumerate(states):
                if i % 10 == 0:
                    assert state.status is CommandStatus.FAILED and state.error == f"no {i}"
                elif i == 7:
                    assert state.status is CommandStatus.FAILED
                    assert "off to queue 'no-such-queue', which the server refused" in state.error
                else:
                    assert state.status is CommandStatus.SUCCEEDED and state.result == {"i": i}
                assert state.attempts == 1
            sizes = [int(r.args[0]) for r in caplog.records if r.msg == "settle request: %d settlement(s)"]
            assert sum(sizes) > n, sizes  # the refused request's items are sent again
            assert len(sizes) < n / 4, sizes  # together, not one request per command

    run(main())


def test_concurrency_key_runs_one_at_a_time_on_a_keyed_queue(server: BatonServer) -> None:
    """Queue ``keyed`` has ``concurrency_per_key = 1``: of two commands of one key the second
    starts only after the first ended, while a command of another key runs beside the first
    (the worker takes 3 at once)."""
    spans: Dict[str, List[float]] = {}

    async def handler(job: Job) -> Any:
        spans[job.id] = [time.monotonic()]
        await asyncio.sleep(0.6)
        spans[job.id].append(time.monotonic())
        return job.id

    async def main() -> None:
        async with client(server) as c:
            for cid, key in (("ka-1", "tenant-a"), ("ka-2", "tenant-a"), ("kb-1", "tenant-b")):
                state = await c.submit("keyed", "t", id=cid, concurrency_key=key)
                assert state.concurrency_key == key
            async with running(make_worker(server, handler, queue="keyed", concurrency=3)):
                states = [await c.wait(cid, timeout=20) for cid in ("ka-1", "ka-2", "kb-1")]
            assert [(s.id, s.status, s.concurrency_key) for s in states] == [
                ("ka-1", CommandStatus.SUCCEEDED, "tenant-a"),
                ("ka-2", CommandStatus.SUCCEEDED, "tenant-a"),
                ("kb-1", CommandStatus.SUCCEEDED, "tenant-b"),
            ]
            (a1_start, a1_end), (a2_start, _), (b1_start, _) = spans["ka-1"], spans["ka-2"], spans["kb-1"]
            assert a2_start >= a1_end, f"ka-2 started {a1_end - a2_start:.3f}s before ka-1 ended: {spans}"
            assert b1_start < a1_end, f"kb-1 waited for tenant-a: {spans}"

    run(main())


def test_claim_wait_above_the_servers_long_poll_timeout_is_cut_to_it(tmp_path: Path) -> None:
    """``claim_wait`` 20 s against ``--long-poll-timeout 1s``: the server cuts each claim's wait
    to 1 s (it used to refuse it with 400); the worker claims and runs commands as usual."""
    from support import start_baton, stop_process

    srv = start_baton(tmp_path, "memory", None, extra_args=["--long-poll-timeout", "1s"])
    try:

        async def main() -> None:
            async with client(srv) as c:
                sent = time.monotonic()
                got = await c.request("POST", "/v1/queues/jobs/workers/probe/claim", {"wait": "20s"})
                assert got == {"leases": []}
                assert 0.8 < time.monotonic() - sent < 5.0
                async with running(make_worker(srv, lambda job: "ok", claim_wait="20s")):
                    await asyncio.sleep(1.5)  # a claim or two came back empty meanwhile
                    await c.submit("jobs", "t", id="lp-1")
                    state = await c.wait("lp-1", timeout=10)
                assert state.status is CommandStatus.SUCCEEDED and state.result == "ok"

        run(main())
    finally:
        stop_process(srv.proc, graceful=False)


def test_type_without_a_handler_fails_clearly(server: BatonServer) -> None:
    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "mystery", id="u-1")
            worker = make_worker(server, {"a": lambda job: 1, "b": lambda job: 2}, name="typed-worker")
            async with running(worker):
                state = await c.wait("u-1", timeout=10)
            assert state.status is CommandStatus.FAILED
            assert state.error == "no handler for command type 'mystery' in worker typed-worker (it handles: a, b)"

    run(main())


def test_release_hands_it_back_unrun(server: BatonServer) -> None:
    seen: List[int] = []

    def handler(job: Job) -> Any:
        seen.append(job.deliveries)
        return Release() if job.deliveries == 1 else "second delivery"

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="rel-1")
            async with running(make_worker(server, handler)):
                state = await c.wait("rel-1", timeout=10)
            assert seen == [1, 2]
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == "second delivery"
            assert state.attempts == 1  # a release is a delivery, not an attempt

    run(main())


def test_unknown_queue_stops_the_worker_with_the_error(server: BatonServer) -> None:
    async def main() -> None:
        worker = make_worker(server, lambda job: None, queue="nope")
        with pytest.raises(NotFoundError) as info:
            await asyncio.wait_for(worker.run(), 10)
        assert info.value.code == "unknown_queue"

    run(main())


# --- leases hold whatever the handler does ---


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_blocking_handler_runs_exactly_once(server: BatonServer, kind: str) -> None:
    """The handler blocks (``time.sleep``) for 5× the claim timeout; an ``async def`` one blocks
    the event loop itself. The renewal process keeps the lease: one execution, one delivery.
    (With a lost lease the free second slot would claim the redelivery and run it again.)"""
    executions: List[Tuple[str, int]] = []
    lock = threading.Lock()

    def work(job: Job) -> Any:
        with lock:
            executions.append((job.id, job.deliveries))
        time.sleep(5 * CLAIM_TIMEOUT)
        return {"slept": 5 * CLAIM_TIMEOUT}

    if kind == "def":
        handler: Any = work
    else:

        async def handler(job: Job) -> Any:
            return work(job)  # blocks the loop

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "block", id="b-1")
            async with running(make_worker(server, handler, concurrency=2, claim_wait="1s")):
                state = await c.wait("b-1", timeout=30)
                await asyncio.sleep(0.2)  # a duplicate started at the end would show now
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"slept": 5 * CLAIM_TIMEOUT}
            assert state.attempts == 1
            assert executions == [("b-1", 1)]

    run(main())


def renewal_processes(parent: int) -> List[int]:
    """The pids of ``parent``'s lease renewal processes (Linux: from ``/proc``; else none)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"baton_client._renewal" in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gil_holding_call(seconds: float) -> Any:
    """A function that holds the GIL for about ``seconds`` in one C call: ``sum(range(n))``
    (the builtin loops in C without ever letting another thread run), ``n`` calibrated here."""
    n = 10**6
    while True:
        t0 = time.perf_counter()
        sum(range(n))
        took = time.perf_counter() - t0
        if took >= 0.1:
            break
        n *= 4
    big = int(n * seconds / took)
    return lambda: sum(range(big))


# Submits the command "victim-1" after DELAY seconds, then claims from QUEUE as worker
# "competitor" for FOR seconds, settling what it gets; writes [[id, deliveries], ...] to OUT.
COMPETITOR = """
import json, sys, time
import httpx
url, queue, out, delay, until = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
start = time.monotonic()
got = []
with httpx.Client(timeout=10) as c:
    time.sleep(max(0.0, delay - (time.monotonic() - start)))
    c.post(f"{url}/v1/queues/{queue}/commands", json={"id": "victim-1", "type": "victim"}).raise_for_status()
    time.sleep(0.5)  # the worker's outstanding claim takes it first
    while time.monotonic() - start < until:
        answer = c.post(f"{url}/v1/queues/{queue}/workers/competitor/claim", json={"max": 10, "wait": "1s"})
        for lease in answer.json()["leases"]:
            got.append([lease["command"]["id"], lease["deliveries"]])
            result = {"by": "competitor", "deliveries": lease["deliveries"]}
            c.post(f"{url}/v1/queues/{queue}/workers/competitor/settle",
                   json={"lease": lease["lease"], "outcome": "succeeded", "result": result})
with open(out, "w") as f:
    json.dump(got, f)
"""


def test_handler_holding_the_gil_keeps_its_lease(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A handler holds the GIL for 3× the claim timeout in one C call: no thread of the worker
    process runs meanwhile (a ticking thread shows it), but renewals come from a process of
    their own, so its lease holds: one execution, one delivery, SUCCEEDED. Another worker (a
    process) claims all along and never gets it.

    Meanwhile a second command reaches the worker's outstanding claim, whose answer the worker
    cannot read until the GIL is free: that lease lapses and the other worker takes it over.
    When the worker reads the claim's answer at last, it sees the lease came late and waits for
    a renewal before starting the handler: the renewal says ``lost`` (or ``gone``, once the other
    worker settled it), and the handler never runs (one run of the command, by the other one)."""

    srv = start_baton(tmp_path, "memory", None)
    hold = _gil_holding_call(3 * SLOW_CLAIM_TIMEOUT)
    competitor_out = tmp_path / "competitor.json"
    executions: List[Tuple[str, int]] = []
    go = threading.Event()
    held: Dict[str, float] = {}

    def hog(job: Job) -> Any:
        executions.append((job.id, job.deliveries))
        go.wait(30)
        t0 = time.monotonic()
        hold()
        held["start"], held["end"] = t0, time.monotonic()
        return {"held": True}

    def victim(job: Job) -> Any:
        executions.append((job.id, job.deliveries))
        return {"by": "worker"}

    ticks: List[float] = []
    ticking = threading.Event()

    def tick() -> None:
        while not ticking.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    competitor = None

    async def main() -> None:
        nonlocal competitor
        caplog.set_level(logging.INFO, logger="baton_client.worker")
        async with client(srv) as c:
            await c.submit("slow", "hog", id="hog-1")
            # Concurrency 2: while the hog runs, a claim for the free slot waits (20 s) for more.
            worker = make_worker(srv, {"hog": hog, "victim": victim}, queue="slow", concurrency=2, claim_wait="20s")
            async with running(worker):
                await wait_until(lambda: len(executions) == 1)
                await asyncio.sleep(0.2)  # the next claim is on its way
                ticker = threading.Thread(target=tick, daemon=True)
                ticker.start()
                # Submits victim-1 1 s into the GIL hold, then claims from 1.5 s to 5.5 s.
                competitor = subprocess.Popen(
                    [sys.executable, "-c", COMPETITOR, srv.url, "slow", str(competitor_out), "1.0",
                     str(2.75 * SLOW_CLAIM_TIMEOUT)]
                )
                go.set()
                state = await c.wait("hog-1", timeout=20)
                ticking.set()
                other = await c.wait("victim-1", timeout=20)
                await wait_until(lambda: not worker.active_jobs, timeout=10)
                await asyncio.sleep(0.2)  # a duplicate started at the end would show now
            code = await asyncio.get_running_loop().run_in_executor(None, competitor.wait, 20)
            assert code == 0
            taken = json.loads(competitor_out.read_text())
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"held": True}
            assert state.attempts == 1
            assert executions == [("hog-1", 1)]  # victim-1 never ran here
            assert taken == [["victim-1", 2]]  # the hog's lease held; victim-1 came to us first
            assert other.status is CommandStatus.SUCCEEDED
            assert other.result == {"by": "competitor", "deliveries": 2}
            messages = [r.getMessage() for r in caplog.records]
            lost = [m for m in messages if m.startswith("lease of command victim-1 is ")]
            assert lost in (  # lost, or gone when the other worker settled it first
                ["lease of command victim-1 is lost: another worker may run it; it will not be settled here"],
                ["lease of command victim-1 is gone: another worker may run it; it will not be settled here"],
            ), messages
            # The GIL was really held: past the claim timeout, and no other thread ran meanwhile.
            seconds = held["end"] - held["start"]
            assert seconds >= 1.5 * SLOW_CLAIM_TIMEOUT, held
            during = [t for t in ticks if held["start"] - 0.1 <= t <= held["end"] + 0.1]
            gaps = [b - a for a, b in zip(during, during[1:])]
            assert gaps and max(gaps) >= 0.9 * seconds, (held, max(gaps or [0]))

    try:
        run(main())
    finally:
        ticking.set()
        if competitor is not None:
            stop_process(competitor, graceful=False)
        stop_process(srv.proc, graceful=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the renewal process in /proc")
def test_killed_renewal_process_is_replaced(memory_server: BatonServer, caplog: pytest.LogCaptureFixture) -> None:
    """The worker's lease renewal process is killed while a handler runs (3× the claim
    timeout): the worker starts another at once and tells it its leases, which hold (the free
    second slot never gets the command again). One execution, SUCCEEDED."""
    server = memory_server
    executions: List[int] = []
    started = threading.Event()

    def handler(job: Job) -> Any:
        executions.append(job.deliveries)
        started.set()
        time.sleep(3 * CLAIM_TIMEOUT)
        return "done"

    async def main() -> None:
        caplog.set_level(logging.INFO, logger="baton_client.worker")
        async with client(server) as c:
            await c.submit("jobs", "t", id="rk-1")
            async with running(make_worker(server, handler, concurrency=2, claim_wait="1s")):
                await wait_until(started.is_set)
                [first] = renewal_processes(os.getpid())
                os.kill(first, signal.SIGKILL)
                await wait_until(lambda: [p for p in renewal_processes(os.getpid()) if p != first and alive(p)])
                state = await c.wait("rk-1", timeout=15)
                await asyncio.sleep(0.2)
            assert state.status is CommandStatus.SUCCEEDED and state.result == "done"
            assert state.attempts == 1
            assert executions == [1]
            messages = [r.getMessage() for r in caplog.records]
            assert "the lease renewal process exited (code -9) while the worker runs: starting another" in messages
            assert not any("lease lost" in m or "will not be settled" in m for m in messages), messages
        assert not [p for p in renewal_processes(os.getpid()) if alive(p)]  # stopped with the worker

    run(main())


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_worker_process_command_finished_by_another(server: BatonServer, tmp_path: Path, how: str) -> None:
    """A worker process dies (SIGKILL) or is stopped (SIGTERM: it releases the lease) while its
    handler runs; a second worker finishes the command after the claim timeout. Its lease
    renewal process ends with it, at once (or the dead worker's lease would be renewed forever)."""
    marker = tmp_path / "marker"
    log = open(tmp_path / "worker_proc.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "worker_proc.py"), server.url, "jobs", str(marker)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    second: List[Tuple[str, int, float]] = []

    def lines() -> List[str]:
        return marker.read_text().splitlines() if marker.exists() else []

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", {"k": 1}, id="k-1")
            await wait_until(lambda: len(lines()) >= 1, timeout=20)
            renewers = renewal_processes(proc.pid)
            if sys.platform.startswith("linux"):
                assert len(renewers) == 1, renewers
            proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
            code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10)
            stopped_at = time.monotonic()
            if how == "SIGKILL":
                assert code == -signal.SIGKILL
            else:
                assert code == 0, (tmp_path / "worker_proc.log").read_text()
                assert lines()[-1] == "exited"
            await wait_until(lambda: not any(alive(pid) for pid in renewers), timeout=1.0)

            def handler(job: Job) -> Any:
                second.append((job.id, job.deliveries, time.monotonic() - stopped_at))
                return {"by": "second"}

            async with running(make_worker(server, handler, claim_wait="1s")):
                state = await c.wait("k-1", timeout=20)
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"by": "second"}
            assert state.attempts == 1
            assert lines()[0] == "k-1 1"
            assert [(i, d) for (i, d, _) in second] == [("k-1", 2)]

    try:
        run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the renewal process sees a stopped worker in /proc")
def test_stopped_worker_process_command_finished_by_another(memory_server: BatonServer, tmp_path: Path) -> None:
    """A worker process is stopped (SIGSTOP) while its handler runs: it works on nothing, so its
    renewal process (which runs on) renews nothing either, and a second worker finishes the
    command after the claim timeout (a second delivery)."""
    server = memory_server
    marker = tmp_path / "marker"
    log = open(tmp_path / "worker_proc.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "worker_proc.py"), server.url, "jobs", str(marker)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    second: List[Tuple[str, int]] = []

    def handler(job: Job) -> Any:
        second.append((job.id, job.deliveries))
        return {"by": "second"}

    async def main() -> None:
        async with client(server) as c:
            await c.submit("jobs", "t", id="st-1")
            await wait_until(lambda: marker.exists() and marker.read_text() == "st-1 1\n", timeout=20)
            proc.send_signal(signal.SIGSTOP)
            async with running(make_worker(server, handler, claim_wait="1s")):
                state = await c.wait("st-1", timeout=10)
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"by": "second"}
            assert second == [("st-1", 2)]

    try:
        run(main())
    finally:
        proc.kill()
        proc.wait()
        log.close()


# --- cancellation ---


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_cancel_signals_the_running_handler(
    server: BatonServer, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    started = threading.Event()
    seen: Dict[str, Any] = {}

    if kind == "def":

        def handler(job: Job) -> Any:
            started.set()
            fired = job.cancelled.wait(20)
            seen.update(at=time.monotonic(), fired=fired, reason=job.cancel_reason)
            return {"late": "result"}  # must not be stored

    else:

        async def handler(job: Job) -> Any:
            started.set()
            try:
                await asyncio.sleep(20)
            except asyncio.CancelledError:  # the task is cancelled too
                reason = await job.wait_cancelled()
                seen.update(at=time.monotonic(), fired=job.cancelled.is_set(), reason=reason)
            return {"late": "result"}

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        async with client(server) as c:
            await c.submit("jobs", "t", id="x-1")
            worker = make_worker(server, handler)
            async with running(worker):
                await wait_until(started.is_set)
                cancelled_at = time.monotonic()
                assert (await c.cancel("x-1")).status is CommandStatus.CANCELLED
                await wait_until(lambda: "at" in seen, timeout=5)
                await wait_until(lambda: not worker.active_jobs, timeout=5)  # settled
            # Signalled within about one renewal interval (a third of the 1 s claim timeout;
            # the bound leaves room for a loaded machine).
            assert seen["at"] - cancelled_at < 1.5 * CLAIM_TIMEOUT, seen["at"] - cancelled_at
            assert seen["fired"] is True
            assert seen["reason"] is CancelReason.CANCELLED
            state = await c.get("x-1")
            assert state.status is CommandStatus.CANCELLED
            assert state.result is None
            settled = [r.getMessage() for r in caplog.records if "settled" in r.getMessage()]
            assert settled == ["command x-1 settled: cancelled (applied: False)"]

    run(main())


# --- graceful shutdown ---


def test_graceful_shutdown_releases_unfinished_leases(server: BatonServer) -> None:
    started: Dict[str, int] = {}
    reasons: Dict[str, Any] = {}

    def handler(job: Job) -> Any:
        started[job.id] = job.deliveries
        if job.params == "quick":
            time.sleep(0.3)  # ends within the grace period: settled normally
            return {"by": "A"}
        job.cancelled.wait(30)
        reasons[job.id] = job.cancel_reason
        job.raise_if_cancelled()
        return {"by": "A"}

    second: List[Tuple[str, int]] = []

    def handler_b(job: Job) -> Any:
        second.append((job.id, job.deliveries))
        return {"by": "B"}

    async def main() -> None:
        async with client(server) as c:
            for cid, params in (("s-1", "slow"), ("s-2", "slow"), ("s-3", "quick")):
                await c.submit("jobs", "t", params, id=cid)
            a = make_worker(server, handler, concurrency=3, shutdown_grace=0.6, cancel_grace=1.0)
            task = asyncio.ensure_future(a.run())
            await wait_until(lambda: len(started) == 3)
            stop_at = time.monotonic()
            a.stop()
            await asyncio.wait_for(task, 10)
            stopped_in = time.monotonic() - stop_at
            assert 0.6 <= stopped_in < 3.0, stopped_in  # the 0.6 s grace, then the signal
            assert reasons == {"s-1": CancelReason.SHUTDOWN, "s-2": CancelReason.SHUTDOWN}
            quick = await c.get("s-3")
            assert quick.status is CommandStatus.SUCCEEDED and quick.result == {"by": "A"}
            for cid in ("s-1", "s-2"):
                state = await c.get(cid)
                assert state.status is CommandStatus.SUBMITTED and state.attempts == 0

            async with running(make_worker(server, handler_b, concurrency=2, claim_wait="1s")):
                s1 = await c.wait("s-1", timeout=10)
                s2 = await c.wait("s-2", timeout=10)
            for state in (s1, s2):
                assert state.status is CommandStatus.SUCCEEDED
                assert state.result == {"by": "B"}
                assert state.attempts == 1
            assert sorted(second) == [("s-1", 2), ("s-2", 2)]

    run(main())


# --- concurrency ---


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_concurrency_limit_and_exactly_once(server: BatonServer, kind: str) -> None:
    n, k = 12, 3
    lock = threading.Lock()
    current = [0]
    peak = [0]
    runs: Counter = Counter()

    def enter(job: Job) -> None:
        with lock:
            current[0] += 1
            peak[0] = max(peak[0], current[0])
            runs[job.id] += 1

    def leave() -> None:
        with lock:
            current[0] -= 1

    if kind == "def":

        def handler(job: Job) -> Any:
            enter(job)
            time.sleep(0.15)
            leave()
            return {"n": job.params["n"]}

    else:

        async def handler(job: Job) -> Any:  # type: ignore[misc]
            enter(job)
            await asyncio.sleep(0.15)
            leave()
            return {"n": job.params["n"]}

    async def main() -> None:
        async with client(server) as c:
            ids = [f"n-{i}" for i in range(n)]
            await asyncio.gather(*(c.submit("jobs", "t", {"n": i}, id=cid) for i, cid in enumerate(ids)))
            async with running(make_worker(server, handler, concurrency=k)):
                states = await asyncio.gather(*(c.wait(cid, timeout=20) for cid in ids))
            for i, state in enumerate(states):
                assert state.status is CommandStatus.SUCCEEDED
                assert state.result == {"n": i}
                assert state.attempts == 1
            assert runs == {cid: 1 for cid in ids}
            assert peak[0] == k

    run(main())


def test_worker_name_default_is_host_pid_random() -> None:
    w = Worker("http://127.0.0.1:1", "jobs", lambda job: None)
    assert f"-{os.getpid()}-" in w.name
    assert 1 <= len(w.name.encode()) <= 128
    assert Worker("http://127.0.0.1:1", "jobs", lambda job: None).name != w.name


def test_server_frozen_past_the_claim_timeout_does_not_end_the_lease(
    server: BatonServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server freezes (SIGSTOP) for 3× the claim timeout while a handler runs: renewals get
    no answer (timeouts), which says nothing about the lease. The handler is not signalled and
    keeps running; once the server is back the renewals say ``held`` and the handler's result
    is settled: one delivery, one attempt. (Concurrency 1: no claim of this worker's own could
    take the command over when the server wakes up.)"""
    seen: List[Tuple[int, Any]] = []
    finish = threading.Event()

    def handler(job: Job) -> Any:
        finish.wait(30)
        seen.append((job.deliveries, job.cancel_reason))
        return "first"

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        async with client(server) as c:
            await c.submit("jobs", "t", id="frozen-1")
            async with running(make_worker(server, handler, concurrency=1, claim_wait="1s")) as worker:
                await wait_until(lambda: len(worker.active_jobs) == 1)
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(3 * CLAIM_TIMEOUT)
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
                await asyncio.sleep(CLAIM_TIMEOUT)  # renewals answered again
                assert [j.cancel_reason for j in worker.active_jobs] == [None]
                finish.set()
                state = await c.wait("frozen-1", timeout=20)
            assert seen == [(1, None)]
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == "first"
            assert state.attempts == 1
            messages = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("renewing 1 lease(s) failed (1 in a row") for m in messages), messages
            assert not any("lease lost" in m or "will not be settled" in m for m in messages), messages
            assert "command frozen-1 settled: succeeded (applied: True)" in messages

    run(main())


def test_renewals_and_settlements_without_a_definite_answer_keep_the_lease(
    memory_server: BatonServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a proxy, the renewals are answered 503, then 500, then not at all (the connection
    is closed), each for the claim timeout: none is an answer about the lease. The handler is
    not signalled; its settlement, answered 503, 500 and dropped in turn, is retried until the
    server answers: SUCCEEDED, one delivery, one attempt."""
    server = memory_server
    seen: List[Tuple[int, Any]] = []
    finish = threading.Event()

    def handler(job: Job) -> Any:
        finish.wait(30)
        seen.append((job.deliveries, job.cancel_reason))
        return "kept"

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        proxy = FaultProxy(server.url)
        await proxy.start()
        try:
            async with client(server) as c:
                await c.submit("jobs", "t", id="faults-1")
                worker = Worker(proxy.url, "jobs", handler, concurrency=1, claim_wait="1s", shutdown_grace=2.0)
                async with running(worker):
                    await wait_until(lambda: len(worker.active_jobs) == 1)
                    for fault in (503, 500, "drop"):
                        proxy.always["/renew"] = fault
                        await asyncio.sleep(CLAIM_TIMEOUT)
                    proxy.always["/renew"] = None
                    await asyncio.sleep(CLAIM_TIMEOUT)  # renewals answered again
                    assert [j.cancel_reason for j in worker.active_jobs] == [None]
                    proxy.once["/settle"] = [503, 500, "drop"]
                    finish.set()
                    state = await c.wait("faults-1", timeout=20)
        finally:
            await proxy.close()
        assert seen == [(1, None)]
        assert state.status is CommandStatus.SUCCEEDED
        assert state.result == "kept"
        assert state.attempts == 1
        for fault in (503, 500, "drop"):
            assert proxy.seen[("/renew", fault)] >= 1, proxy.seen
            assert proxy.seen[("/settle", fault)] == 1, proxy.seen
        assert proxy.seen[("/settle", "pass")] == 1, proxy.seen
        messages = [r.getMessage() for r in caplog.records]
        assert not any("lease lost" in m or "will not be settled" in m for m in messages), messages
        assert "command faults-1 settled: succeeded (applied: True)" in messages

    run(main())


def test_stopping_worker_gives_up_a_settlement_without_an_answer(
    memory_server: BatonServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every settle request is answered 503: the settlement is retried while the worker runs,
    and for ``_SETTLE_ON_STOP`` seconds (1 s here) once it stops after its handlers ended; then
    the worker gives up, logs it and returns. Its renewals end with it: the lease lapses and
    another worker runs the command (a second delivery)."""
    server = memory_server
    import baton_client._worker as worker_module

    monkeypatch.setattr(worker_module, "_SETTLE_ON_STOP", 1.0, raising=False)
    second: List[int] = []

    def handler_b(job: Job) -> Any:
        second.append(job.deliveries)
        return "by b"

    async def main() -> None:
        caplog.set_level(logging.INFO, logger="baton_client.worker")
        proxy = FaultProxy(server.url)
        await proxy.start()
        proxy.always["/settle"] = 503
        try:
            async with client(server) as c:
                await c.submit("jobs", "t", id="gu-1")
                a = Worker(proxy.url, "jobs", lambda job: "by a", claim_wait="1s", shutdown_grace=0.5, cancel_grace=0.5)
                task = asyncio.ensure_future(a.run())
                await wait_until(lambda: proxy.seen[("/settle", 503)] >= 2)
                stop_at = time.monotonic()
                a.stop()
                await asyncio.wait_for(task, 10)
                stopped_in = time.monotonic() - stop_at
                assert stopped_in < 0.5 + 0.5 + 1.0 + 1.5, stopped_in
                messages = [r.getMessage() for r in caplog.records]
                gave_up = [m for m in messages if m.startswith("command gu-1: gave up settling it (succeeded)")]
                assert len(gave_up) == 1, messages
                assert (await c.get("gu-1")).status is CommandStatus.SUBMITTED
                async with running(make_worker(server, handler_b, claim_wait="1s")):
                    state = await c.wait("gu-1", timeout=10)
                assert state.status is CommandStatus.SUCCEEDED and state.result == "by b"
                assert second == [2]
        finally:
            await proxy.close()

    run(main())


def test_redis_paused_past_the_claim_timeout_does_not_end_the_lease(
    redis_only: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis is paused (``CLIENT PAUSE … ALL``) for 2.5× the claim timeout while a handler runs:
    the server cannot answer renewals in time (the requests time out), which says nothing about
    the lease. The handler is not signalled, runs once, and its result is settled after the
    pause. (Concurrency 1: no claim of this worker's own could take the command over when Redis
    is back.)"""
    redis_server = redis_only
    srv = start_baton(tmp_path, "redis", redis_server)
    seen: List[Tuple[int, Any]] = []
    started = threading.Event()
    finish = threading.Event()

    def handler(job: Job) -> Any:
        started.set()
        finish.wait(30)
        seen.append((job.deliveries, job.cancel_reason))
        return {"after": "pause"}

    async def main() -> None:
        caplog.set_level(logging.DEBUG, logger="baton_client.worker")
        async with client(srv) as c:
            await c.submit("slow", "t", id="paused-1")
            async with running(make_worker(srv, handler, queue="slow", concurrency=1, claim_wait="1s")) as worker:
                await wait_until(started.is_set)
                pause = 2.5 * SLOW_CLAIM_TIMEOUT
                assert redis_server.command(b"CLIENT", b"PAUSE", b"%d" % int(pause * 1000), b"ALL") == b"+OK"
                paused_at = time.monotonic()
                await asyncio.sleep(pause + SLOW_CLAIM_TIMEOUT / 2)  # renewals answered again
                assert [j.cancel_reason for j in worker.active_jobs] == [None]
                finish.set()
                state = await c.wait("paused-1", timeout=20)
                assert time.monotonic() - paused_at >= pause
            assert seen == [(1, None)]
            assert state.status is CommandStatus.SUCCEEDED
            assert state.result == {"after": "pause"}
            assert state.attempts == 1
            messages = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("renewing 1 lease(s) failed (1 in a row") for m in messages), messages
            assert not any("lease lost" in m or "will not be settled" in m for m in messages), messages

    try:
        run(main())
    finally:
        stop_process(srv.proc, graceful=False)

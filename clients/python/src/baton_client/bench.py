"""Throughput of the SDK worker: drain N pre-submitted no-op commands.

    python -m baton_client.bench --url http://127.0.0.1:7700 --queue jobs --count 5000

Submits ``--count`` commands (type ``noop``) concurrently over HTTP, then starts the clock and
a :class:`Worker` with a no-op ``async def`` handler at ``--concurrency``, and stops the clock
when the queue's ``SUCCEEDED`` count (``GET /v1/queues/{queue}``, polled every 20 ms) has grown
by ``count``. Prints one JSON line::

    {"sdk":"python","count":5000,"concurrency":64,"seconds":…,"per_second":…}

The queue must have no handlers (served by ``baton serve --no-workers``) and should be empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, Dict, List, Optional

from ._client import BatonClient
from ._job import Job
from ._worker import Worker


async def _noop(job: Job) -> None:
    return None


async def _succeeded(client: BatonClient, queue: str) -> int:
    info = await client.request("GET", f"/v1/queues/{queue}")
    return int(info["commands"]["succeeded"])


async def bench(
    url: str,
    queue: str,
    count: int,
    concurrency: int,
    token: Optional[str] = None,
    submitters: int = 8,
    timeout: float = 600.0,
) -> Dict[str, Any]:
    """Run the benchmark; returns the result object (see the module's doc)."""
    async with BatonClient(url, token=token) as client:
        before = await _succeeded(client, queue)
        todo = iter(range(count))

        async def submitter() -> None:
            for _ in todo:
                await client.submit(queue, "noop")

        await asyncio.gather(*(submitter() for _ in range(min(submitters, count))))

        worker = Worker(url, queue, _noop, concurrency=concurrency, token=token, name=None)
        start = time.perf_counter()
        task = asyncio.ensure_future(worker.run())
        deadline = time.monotonic() + timeout
        try:
            while await _succeeded(client, queue) - before < count:
                if task.done():
                    task.result()  # raises the worker's error
                    raise RuntimeError("the worker stopped before the queue was drained")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{count} commands not drained within {timeout}s")
                await asyncio.sleep(0.02)
            seconds = time.perf_counter() - start
        finally:
            worker.stop(now=True)
            await task
    return {
        "sdk": "python",
        "count": count,
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        "per_second": round(count / seconds, 1),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m baton_client.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7700", help="baton serve's URL")
    parser.add_argument("--queue", default="jobs", help="a queue without handlers (default jobs)")
    parser.add_argument("--count", type=int, default=5000, help="commands to drain (default 5000)")
    parser.add_argument("--concurrency", type=int, default=64, help="worker concurrency (default 64)")
    parser.add_argument("--token", default=None, help="a bearer token (write and work on the queue)")
    args = parser.parse_args(argv)
    result: Any = asyncio.run(bench(args.url, args.queue, args.count, args.concurrency, token=args.token))
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

"""Submit commands for examples/worker.py and wait for their results."""

from __future__ import annotations

import argparse
import asyncio

from baton_client import BatonClient


async def main(url: str, queue: str) -> None:
    async with BatonClient(url) as baton:
        a = await baton.submit(queue, "checksum", {"text": "hello", "rounds": 3})
        b = await baton.submit(queue, "report", {"month": "2026-11"})
        c = await baton.submit(queue, "checksum", {"text": 42})
        for state in await asyncio.gather(*(baton.wait(s.id, timeout=60) for s in (a, b, c))):
            print(f"{state.id} {state.type}: {state.status} result={state.result} error={state.error}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:7700")
    parser.add_argument("--queue", default="jobs")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.queue))

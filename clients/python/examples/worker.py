"""A Baton worker in Python: run it against `baton serve --no-workers`.

    cat > baton.toml <<'TOML'
    [queues.jobs]
    claim_timeout = "10s"
    TOML
    baton serve --config baton.toml --no-workers &
    python examples/worker.py --url http://127.0.0.1:7700 --queue jobs &
    python examples/submit.py --url http://127.0.0.1:7700 --queue jobs

Stop it with Ctrl-C or SIGTERM: it stops claiming, lets running handlers finish for up to
10 s, then signals them and hands their commands back (another worker runs them).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
from typing import Any, Dict

from baton_client import Failed, Job, Running, Worker


def checksum(job: Job) -> Dict[str, Any]:
    """A plain `def`: runs in its own thread, so it may block (CPU work, sleeps, sync I/O)."""
    text = job.params.get("text") if isinstance(job.params, dict) else None
    if not isinstance(text, str):
        raise Failed("params.text must be a string")  # FAILED, not retried
    digest = hashlib.sha256()
    for _ in range(int(job.params.get("rounds", 1))):
        job.raise_if_cancelled()  # stop promptly when the command is cancelled
        digest.update(text.encode())
        time.sleep(0.01)
    return {"sha256": digest.hexdigest()}


async def report(job: Job) -> Any:
    """An `async def`: `execute` starts the work, `check_status` calls finish it."""
    if job.call == "execute":
        logging.info("report %s: started; checking again in 1 s", job.id)
        return Running(next_check=1.0)
    await asyncio.sleep(0.1)
    return {"report": f"ready after {job.deliveries} deliveries", "params": job.params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7700")
    parser.add_argument("--queue", default="jobs")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--token", default=None, help="a bearer token with `work` on the queue")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    worker = Worker(
        args.url,
        args.queue,
        {"checksum": checksum, "report": report},  # other types end FAILED with a clear message
        concurrency=args.concurrency,
        token=args.token,
        handle_signals=True,
    )
    worker.run_sync()


if __name__ == "__main__":
    main()

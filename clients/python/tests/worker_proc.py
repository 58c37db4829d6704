"""A worker process for the tests that kill or stop one: ``python worker_proc.py URL QUEUE MARKER``.

Its handler appends ``<command id> <deliveries>`` to MARKER when it starts, then waits up to
60 s for its cancellation signal; on SIGTERM (handled by the worker) the signal fires after
the 0.5 s shutdown grace and the handler raises ``JobCancelled``, so the lease is released.
"""

from __future__ import annotations

import logging
import sys

from baton_client import Job, Worker


def main() -> None:
    url, queue, marker = sys.argv[1:4]
    logging.basicConfig(level=logging.INFO, format="worker_proc %(levelname)s %(name)s: %(message)s")

    def handler(job: Job) -> object:
        with open(marker, "a") as f:
            f.write(f"{job.id} {job.deliveries}\n")
        job.cancelled.wait(60)
        job.raise_if_cancelled()
        return {"by": "worker_proc"}

    Worker(
        url, queue, handler, concurrency=1, name="worker-proc", shutdown_grace=0.5, cancel_grace=0.5,
        handle_signals=True,
    ).run_sync()
    with open(marker, "a") as f:
        f.write("exited\n")


if __name__ == "__main__":
    main()

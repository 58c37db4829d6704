"""The Python client (`durable-streams` on PyPI, pinned in requirements.txt) against a running
`baton serve`: create, append, read live (long-poll and SSE), resume from a saved offset.

    CONFORMANCE_BASE_URL=http://127.0.0.1:7700 python conformance/python/test_client.py

Exits non-zero (with the failing assertion) when anything is off.
"""

import os
import random
import string
import sys
import threading
import time

from durable_streams import DurableStream

BASE = os.environ.get("CONFORMANCE_BASE_URL")
if not BASE:
    sys.exit("set CONFORMANCE_BASE_URL to the base URL of a running `baton serve`")


def unique(name: str) -> str:
    tag = "".join(random.choices(string.ascii_lowercase, k=8))
    return f"{BASE}/v1/stream/py-client/{name}-{int(time.time() * 1000)}-{tag}"


def live_then_resume(live: str) -> None:
    url = unique(f"json-{live}")
    ds = DurableStream.create(url, content_type="application/json")
    ds.append({"n": 1})

    seen = []
    offsets = []
    ready = threading.Event()
    errors = []

    def reader() -> None:
        try:
            # An explicit offset: the protocol requires one on live reads (400 without it), and
            # this client version omits it unless given.
            with ds.stream(offset="-1", live=live) as res:
                # iter_events pairs each batch with the offset after it (for checkpointing).
                for event in res.iter_events(mode="json"):
                    seen.extend(event.data)
                    offsets.append(event.next_offset)
                    ready.set()
                    if len(seen) >= 3:
                        break
        except Exception as e:  # surfaced below
            errors.append(e)
            ready.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    assert ready.wait(10), "live reader saw nothing"
    ds.append({"n": 2})
    ds.append({"n": 3})
    t.join(15)
    assert not t.is_alive(), f"live reader ({live}) did not receive 3 messages: {seen}"
    assert not errors, errors
    assert seen == [{"n": 1}, {"n": 2}, {"n": 3}], seen

    saved = offsets[-1]
    ds.append({"n": 4})
    with ds.stream(offset=saved, live=False) as res:
        resumed = list(res.iter_json())
    assert resumed == [{"n": 4}], f"resume from {saved} returned {resumed}"
    print(f"python client, live={live}: create, append, live read, resume: ok")


def text_catch_up() -> None:
    url = unique("text")
    ds = DurableStream.create(url, content_type="text/plain")
    for part in ["a", "b", "c"]:
        ds.append(part)
    with ds.stream(live=False) as res:
        assert res.read_text() == "abc"
    head = ds.head()
    assert head.offset, head
    print("python client, text catch-up and head: ok")


if __name__ == "__main__":
    live_then_resume("long-poll")
    live_then_resume("sse")
    text_catch_up()

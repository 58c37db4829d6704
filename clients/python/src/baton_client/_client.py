"""The asyncio client of Baton's command API."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Sequence, TypedDict, Union

import httpx

from ._errors import BatonError, UnavailableError, error_from_response
from ._http import JSON_HEADERS, base_headers, connection_error, decode, dumps, error_of, seg
from ._state import CommandState, Duration, duration_seconds, format_duration

__all__ = ["BatonClient", "MAX_BATCH", "MAX_WAIT", "SubmitItem"]

#: The longest ``?wait=`` the server takes in one request, in seconds (5 minutes).
MAX_WAIT = 300.0

#: The most commands the server takes in one batch request; :meth:`BatonClient.submit_many`
#: sends a longer list as several requests of at most this many.
MAX_BATCH = 1000

# Extra time on top of a server-side wait before the HTTP request itself times out, seconds.
_WAIT_MARGIN = 30.0

_UNSET: Any = object()


class _SubmitItemType(TypedDict):
    type: str


class SubmitItem(_SubmitItemType, total=False):
    """One command of :meth:`BatonClient.submit_many`: a dict with ``type`` and any of the
    other arguments of :meth:`BatonClient.submit` but ``wait`` (same meaning, same defaults)::

        {"type": "resize", "params": {"image": "a.png"}, "id": "job-1", "priority": 5}
        {"type": "resize", "params": {"image": "b.png"}, "concurrency_key": "tenant-7"}
    """

    params: Any
    id: Optional[str]
    output: Union[bool, Dict[str, Any], None]
    run_at: Union[datetime, str, None]
    delay: Optional[Duration]
    concurrency_key: Optional[str]
    priority: Optional[int]


_ITEM_KEYS = ("type", "params", "id", "output", "run_at", "delay", "concurrency_key", "priority")


def _command_body(
    type: str,
    params: Any,
    id: Optional[str],
    output: Union[bool, Dict[str, Any], None],
    run_at: Union[datetime, str, None],
    delay: Optional[Duration],
    concurrency_key: Optional[str],
    priority: Optional[int],
) -> Dict[str, Any]:
    """The JSON body of one submit (also one item of a batch); ``None`` arguments are left out.

    Raises:
        ValueError: both ``run_at`` and ``delay``; a naive ``run_at``; a bad ``delay``.
    """
    payload: Dict[str, Any] = {"type": type}
    if id is not None:
        payload["id"] = id
    if params is not None:
        payload["params"] = params
    if output is not None:
        payload["output"] = output
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    if run_at is not None:
        if isinstance(run_at, datetime):
            if run_at.tzinfo is None:
                raise ValueError("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
            run_at = run_at.isoformat()
        payload["run_at"] = run_at
    if delay is not None:
        payload["delay"] = format_duration(delay)
    if concurrency_key is not None:
        payload["concurrency_key"] = concurrency_key
    if priority is not None:
        payload["priority"] = priority
    return payload


def _item_body(index: int, item: Any) -> bytes:
    """The JSON text of ``items[index]`` of a batch (see :class:`SubmitItem`).

    Raises:
        TypeError: not a mapping, or no string ``type``.
        ValueError: an unknown key, or an option refused as by :meth:`BatonClient.submit`.
        TypeError / ValueError: ``params`` or ``output`` not JSON-serializable.
    """
    if not isinstance(item, Mapping):
        raise TypeError(f"items[{index}] must be a dict like {{'type': 'resize', 'params': {{...}}}}, not {item!r}")
    unknown = sorted(str(k) for k in item if k not in _ITEM_KEYS)
    if unknown:
        raise ValueError(
            f"items[{index}] has unknown key(s) {', '.join(unknown)}; an item has only {', '.join(_ITEM_KEYS)}"
        )
    if not isinstance(item.get("type"), str):
        raise TypeError(f"items[{index}] needs a string 'type', got {item.get('type')!r}")
    try:
        return dumps(
            _command_body(
                item["type"],
                item.get("params"),
                item.get("id"),
                item.get("output"),
                item.get("run_at"),
                item.get("delay"),
                item.get("concurrency_key"),
                item.get("priority"),
            )
        )
    except (TypeError, ValueError) as exc:
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(f"items[{index}]: {exc}") from exc


def _batch_outcome(response: httpx.Response, index: int, result: Any) -> Union[CommandState, BatonError]:
    """One element of a batch answer's ``results``: the state (``created`` from its ``status``)
    or the item's error (the exception :meth:`BatonClient.submit` would raise, not raised)."""
    status = result.get("status") if isinstance(result, dict) else None
    if isinstance(status, int) and not isinstance(status, bool):
        if status in (200, 202) and isinstance(result.get("state"), dict):
            return CommandState.from_json(result["state"], created=status == 202)
        if status >= 400:
            return error_from_response(status, result, None)
    raise BatonError(
        response.status_code,
        "invalid_response",
        f"results[{index}] of the batch answer is neither {{status: 200|202, state}} nor "
        f"{{status: >=400, error, message}}: {str(result)[:200]}",
    )


class BatonClient:
    """An asyncio client of ``baton serve``'s command API (``/v1/queues/{queue}/commands``,
    ``/v1/commands/{id}``).

    Use it as an async context manager, or call :meth:`aclose` when done::

        async with BatonClient("http://127.0.0.1:7700") as baton:
            state = await baton.submit("jobs", "resize", {"image": "a.png"})
            state = await baton.wait(state.id, timeout=60)

    Args:
        url: the server's base URL (``http://host:port``), without ``/v1``.
        token: a bearer token (sent as ``Authorization: Bearer …``); ``None`` sends none.
        timeout: the HTTP timeout of a request in seconds (connect, read, write); a request
            with a server-side ``wait`` gets that wait plus 30 s.
        http_client: an ``httpx.AsyncClient`` to use instead of creating one (its base URL and
            headers are not changed; the client does not close it).
        max_in_flight: at most this many requests at once (others queue in the client);
            long-polls (``wait``) are not counted. httpx's async connection pool gets much
            slower with many concurrent requests (64 at once: about a third of the throughput
            of 4 on a 2-core machine), so a small limit makes ``asyncio.gather`` of many
            submits faster. ``None``: no limit.

    Every method raises :class:`BatonError` (or a subclass: ``NotFoundError`` for ``404``,
    ``ConflictError`` for ``409``, ``UnavailableError`` for ``503``, ``AuthError`` for
    ``401``/``403``, ``BadRequestError`` for ``400``) for an error answer, and
    ``BatonConnectionError`` (``status`` ``None``) when no answer came.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:7700",
        *,
        token: Optional[str] = None,
        timeout: float = 30.0,
        http_client: Optional[httpx.AsyncClient] = None,
        max_in_flight: Optional[int] = 8,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1 (or None)")
        self._max_in_flight = max_in_flight
        self._in_flight: Optional[asyncio.Semaphore] = None  # made in the loop that uses it
        self._base = url.rstrip("/")
        self._timeout = timeout
        self._headers = base_headers(token)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._base

    async def __aenter__(self) -> "BatonClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections (unless the ``httpx.AsyncClient`` was given)."""
        if self._owns_http:
            await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Optional[bytes] = None,
        params: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> httpx.Response:
        headers = dict(self._headers)
        if body is not None:
            headers.update(JSON_HEADERS)
        limit = None
        if timeout is None and self._max_in_flight is not None:  # not a long-poll
            if self._in_flight is None:
                self._in_flight = asyncio.Semaphore(self._max_in_flight)
            limit = self._in_flight
        try:
            if limit is None:
                return await self._send(method, path, body, params, headers, timeout)
            async with limit:
                return await self._send(method, path, body, params, headers, timeout)
        except httpx.HTTPError as exc:
            raise connection_error(exc, f"{method} {path}") from exc

    async def _send(
        self,
        method: str,
        path: str,
        body: Optional[bytes],
        params: Optional[Dict[str, str]],
        headers: Dict[str, str],
        timeout: Optional[float],
    ) -> httpx.Response:
        return await self._http.request(
            method,
            self._base + path,
            content=body,
            params=params,
            headers=headers,
            timeout=timeout if timeout is not None else self._timeout,
        )

    async def submit(
        self,
        queue: str,
        type: str,
        params: Any = None,
        id: Optional[str] = None,
        *,
        wait: Optional[Duration] = None,
        output: Union[bool, Dict[str, Any], None] = None,
        run_at: Union[datetime, str, None] = None,
        delay: Optional[Duration] = None,
        concurrency_key: Optional[str] = None,
        priority: Optional[int] = None,
    ) -> CommandState:
        """Submit a command: ``POST /v1/queues/{queue}/commands``.

        Args:
            queue: a configured queue.
            type: the command type.
            params: any JSON-serializable value; ``None`` sends no ``params``.
            id: the command's id; ``None`` lets the server make one. Submitting the same id
                with the same type and params again is idempotent (``created`` is ``False``).
            wait: hold the answer until the command is terminal or this long passes
                (seconds, or a string like ``"30s"``; at most 5 minutes).
            output: ``True`` gives the command an output stream (``state.output``): created
                now, written by its handler, ended with the command; or a dict with any of
                ``path``, ``content_type``, ``silence_timeout`` (a string like ``"60s"``).
                ``None`` sends nothing. Part of the request: a resubmit of the id with another
                ``output`` is a ``ConflictError``.
            run_at: schedule the command: stored now (``SUBMITTED``, ``state.run_at`` set),
                its handler not called before this time (a timezone-aware ``datetime``, or an
                RFC 3339 string); a time not in the future runs at once. Part of the request:
                a resubmit of the id with another ``run_at`` is a ``ConflictError``.
            delay: schedule it this long from now (seconds, or a string like ``"10m"``); not
                with ``run_at``. A resubmit with a ``delay`` matches any scheduled command of
                the id.
            concurrency_key: a string of 1 to 256 bytes without control characters, stored in
                the state (``state.concurrency_key``); ``None`` sends none. On a queue
                configured with ``concurrency_per_key = N``, at most N commands of one key run
                at once (across every worker), the others waiting and starting in submit order
                as those end; elsewhere it is only stored. Not part of the idempotent body (a
                resubmit of the id returns the stored command whatever key it asks). Empty,
                over 256 bytes or with a control character: ``BadRequestError``
                ``invalid_body``.
            priority: an integer from -10 to 10 (default 0 when ``None``): the queue's workers
                take the waiting command of the highest priority first, in submit order among
                equal ones (strict: a flood of higher priorities holds lower ones back until it
                drains). Out of range: ``BadRequestError`` ``invalid_body``.

        Returns:
            The state, with ``created`` ``True`` (``202``: new) or ``False`` (``200``: the
            same command was already submitted).

        Raises:
            NotFoundError: ``unknown_queue``.
            ConflictError: ``conflict``: the id exists with another type, params or queue.
            BadRequestError: ``invalid_body`` (also a bad ``priority`` or
                ``concurrency_key``), ``invalid_id``, ``unknown_type``, ``invalid_params``, ``body_too_large`` (413), …
            UnavailableError: the backend or the live-reader slots (with ``wait``).
            TypeError / ValueError: ``params`` is not JSON-serializable.
        """
        payload = _command_body(type, params, id, output, run_at, delay, concurrency_key, priority)
        query = None
        timeout = None
        if wait is not None:
            query = {"wait": format_duration(wait)}
            timeout = duration_seconds(wait) + _WAIT_MARGIN
        response = await self._request(
            "POST", f"/v1/queues/{seg(queue)}/commands", body=dumps(payload), params=query, timeout=timeout
        )
        data = decode(response)
        return CommandState.from_json(data, created=response.status_code == 202)

    async def submit_many(
        self, queue: str, items: Sequence[SubmitItem]
    ) -> List[Union[CommandState, BatonError]]:
        """Submit several commands at once: ``POST /v1/queues/{queue}/commands/batch``.

        Each item is decided on its own, as a :meth:`submit` of it would be (the same rules,
        idempotence and errors), and one item's error does not stop the others.

        More than :data:`MAX_BATCH` (1000) items are sent as several requests of at most 1000,
        one after the other, and their results joined in order. An empty list sends nothing.

        Args:
            queue: a configured queue.
            items: dicts (:class:`SubmitItem`) with ``type`` and optionally ``params``, ``id``,
                ``output``, ``run_at``, ``delay``, ``concurrency_key``, ``priority``, as the arguments of
                :meth:`submit`; ``None`` values are left out.

        Returns:
            One outcome per item, in the order of ``items``: a :class:`CommandState` whose
            ``created`` is ``True`` (new) or ``False`` (the same command was already
            submitted, its stored state), or the :class:`BatonError` (subclass by status, e.g.
            ``ConflictError`` ``conflict``, ``BadRequestError`` ``unknown_type``) that
            :meth:`submit` would have raised for that item, returned and not raised; its
            ``body`` is the item's error object.

        Raises:
            NotFoundError: ``unknown_queue`` (nothing stored).
            BadRequestError: the request itself: ``invalid_json``, ``invalid_body``,
                ``body_too_large`` (413: the items' JSON is over the server's limit).
            AuthError / UnavailableError / BatonConnectionError: as for :meth:`submit`. With
                more than 1000 items, the requests before the failed one were stored (their
                outcomes are lost with the exception; resubmitting items with an ``id`` is
                idempotent).
            TypeError / ValueError: an item that is not a dict with a string ``type``, has an
                unknown key, an option :meth:`submit` refuses, or params that are not
                JSON-serializable (naming the item's index; nothing is sent).
        """
        bodies = [_item_body(i, item) for i, item in enumerate(items)]
        chunks = [bodies[at : at + MAX_BATCH] for at in range(0, len(bodies), MAX_BATCH)]
        outcomes: List[Union[CommandState, BatonError]] = []
        for n, chunk in enumerate(chunks):
            sent = len(chunk)
            payload = b'{"commands":[' + b",".join(chunk) + b"]}"
            response = await self._request("POST", f"/v1/queues/{seg(queue)}/commands/batch", body=payload)
            data = decode(response)
            results = data.get("results") if isinstance(data, dict) else None
            if not isinstance(results, list) or len(results) != sent:
                got = f"{len(results)} results" if isinstance(results, list) else f"no results list: {str(data)[:200]}"
                raise BatonError(
                    response.status_code,
                    "invalid_response",
                    f"the batch answer has {got} for {sent} commands",
                )
            outcomes.extend(_batch_outcome(response, n * MAX_BATCH + i, r) for i, r in enumerate(results))
        return outcomes

    async def reschedule(
        self, id: str, *, run_at: Union[datetime, str, None] = None, delay: Optional[Duration] = None
    ) -> CommandState:
        """Move the due time of a scheduled command still waiting for it:
        ``POST /v1/commands/{id}/schedule``. Exactly one of ``run_at`` (a timezone-aware
        ``datetime`` or an RFC 3339 string) and ``delay`` (seconds, or a string like ``"30s"``).

        Raises:
            NotFoundError: ``not_found``.
            ConflictError: ``not_scheduled``: it no longer waits (enqueued, started or ended).
            BadRequestError: ``invalid_body``.
            ValueError: neither or both of ``run_at`` and ``delay``.
        """
        if (run_at is None) == (delay is None):
            raise ValueError("give exactly one of run_at and delay")
        payload: Dict[str, Any] = {}
        if run_at is not None:
            if isinstance(run_at, datetime):
                if run_at.tzinfo is None:
                    raise ValueError("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
                run_at = run_at.isoformat()
            payload["run_at"] = run_at
        else:
            payload["delay"] = format_duration(delay)  # type: ignore[arg-type]
        response = await self._request("POST", f"/v1/commands/{seg(id)}/schedule", body=dumps(payload))
        return CommandState.from_json(decode(response))

    async def get(self, id: str) -> CommandState:
        """The command's current state: ``GET /v1/commands/{id}``.

        Raises:
            NotFoundError: ``not_found`` (unknown or expired).
        """
        return CommandState.from_json(decode(await self._request("GET", f"/v1/commands/{seg(id)}")))

    async def _get_waiting(self, id: str, wait: float) -> CommandState:
        response = await self._request(
            "GET",
            f"/v1/commands/{seg(id)}",
            params={"wait": format_duration(wait)},
            timeout=wait + _WAIT_MARGIN,
        )
        return CommandState.from_json(decode(response))

    async def wait(self, id: str, timeout: Optional[float] = None) -> CommandState:
        """Wait until the command is terminal, or ``timeout`` seconds pass.

        Long-polls ``GET /v1/commands/{id}?wait=…`` in chunks of at most :data:`MAX_WAIT`
        (5 minutes), again and again, so any ``timeout`` works; ``None`` waits without a limit.
        A ``503`` (all live-reader slots taken) is retried after its ``Retry-After``.

        Returns:
            The state: terminal (``state.terminal``), or the latest one when the time ran out.

        Raises:
            NotFoundError: ``not_found``.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        state: Optional[CommandState] = None
        while True:
            remaining = MAX_WAIT if deadline is None else deadline - time.monotonic()
            if remaining < 0.001:
                return state if state is not None else await self.get(id)
            try:
                state = await self._get_waiting(id, min(remaining, MAX_WAIT))
            except UnavailableError as exc:
                delay = exc.retry_after if exc.retry_after is not None else 1.0
                if deadline is not None:
                    delay = min(delay, max(0.0, deadline - time.monotonic()))
                await asyncio.sleep(delay)
                continue
            if state.terminal:
                return state

    async def cancel(self, id: str) -> CommandState:
        """Cancel the command: ``POST /v1/commands/{id}/cancel``.

        A handler running it is signalled (its worker's next renewal says ``cancelled``).

        Returns:
            The ``CANCELLED`` state; **or, when the command had already ended, its unchanged
            terminal state** (``409 already_terminal`` is not raised): check ``state.status``
            to tell whether this call cancelled it (``CANCELLED``) or it had ended otherwise
            (``SUCCEEDED``/``FAILED``; a ``CANCELLED`` one may have been cancelled earlier).

        Raises:
            NotFoundError: ``not_found``.
        """
        response = await self._request("POST", f"/v1/commands/{seg(id)}/cancel")
        if response.status_code == 409:
            err = error_of(response)
            body = err.body or {}
            if err.code == "already_terminal" and isinstance(body.get("state"), dict):
                return CommandState.from_json(body["state"])
            raise err
        return CommandState.from_json(decode(response))

    async def request(self, method: str, path: str, json: Any = _UNSET) -> Any:
        """Any other route of the API: ``method`` on ``path`` (``"/v1/queues/jobs"``) with an
        optional JSON body; returns the parsed JSON answer.

        Raises:
            BatonError: an error answer.
        """
        body = None if json is _UNSET else dumps(json)
        return decode(await self._request(method, path, body=body))


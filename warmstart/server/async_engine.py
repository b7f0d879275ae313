"""The engine on its own thread, fed from the event loop.

Threading model: the Engine is not thread-safe, so exactly one thread ("warmstart-engine") ever touches it. The event
loop hands it work through a thread-safe inbox (submit / abort / stop); the thread runs the step loop while any
request is unfinished, and blocks on the inbox when idle instead of spinning. After each step it snapshots what
changed into immutable Deltas and delivers them to each HTTP request's asyncio.Queue with one
loop.call_soon_threadsafe per step. Handlers never see a live Sequence, so nothing is read while it is written."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from warmstart.engine.engine import Engine, RequestOutput
from warmstart.errors import UserError
from warmstart.runner.batch import TokenLogprobs
from warmstart.sampling_params import SamplingParams

log = logging.getLogger("warmstart.server")


@dataclass(frozen=True)
class SubRequest:
    """One engine sequence: a choice of one prompt. `index` is the choice index in the response."""
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Delta:
    """What one engine step produced for one choice, copied out of the engine thread."""
    index: int
    token_ids: tuple[int, ...]                       # new tokens this step
    text: str                                        # new text that is safe to show
    logprobs: tuple[TokenLogprobs, ...]              # for the new tokens, when logprobs were asked for
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int                           # so far, including these
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None   # on the first delta of a choice that asked
    full_text: str | None = None                     # on the last delta: the whole output text
    num_cached_tokens: int = 0                       # prompt tokens the prefix cache supplied


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of a Delta when the engine raised: the request fails with a 500."""
    message: str


class ClientGone(Exception):
    """The HTTP client disconnected; the stream aborts its engine requests."""


_DISCONNECTED = object()
_STOP = ("stop", None)


@dataclass
class _Route:
    queue: asyncio.Queue
    index: int
    first: bool = True


class AsyncEngine:
    """Owns the engine thread. All public methods are called from the event loop thread."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[Engine, list[RequestOutput]], None] | None = None):
        self.engine, self.loop, self.on_step = engine, loop, on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}          # engine thread only
        self._next = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warmstart-engine", daemon=True)
        self._thread.start()

    # -- event loop side ------------------------------------------------------------------------------------
    def submit(self, subs: list[SubRequest], prefix: str = "req") -> "RequestStream":
        """Queue the sub-requests; returns the stream of their Deltas (use it as an async context manager)."""
        if self._stopped.is_set():
            raise RuntimeError("the engine thread has stopped")
        self._next += 1
        stream = RequestStream(self, {s.index: f"{prefix}-{self._next}-{s.index}" for s in subs})
        self._inbox.put(("add", (stream.queue, [(stream.request_ids[s.index], s) for s in subs])))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(("abort", list(request_ids)))

    def abort_all(self) -> None:
        """Abort every request in flight; each listener gets a final Delta with finish_reason "abort"."""
        self._inbox.put(("abort_all", None))

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Abort everything in flight (its listeners get finish_reason "abort"), free blocks, stop the thread.
        True once the thread has stopped: only then may another thread read the engine or the KV cache."""
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine, flush = self.engine, False
        try:
            while True:
                idle = not engine.has_unfinished and not flush
                if not self._drain(block=idle):
                    break
                flush = False
                try:
                    outputs = engine.step()
                except Exception as e:      # a bug, not bad input: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"The engine failed: {type(e).__name__}: {e}")
                    flush = True
                    continue
                if outputs:
                    self._deliver(outputs)
                    flush = any(o.finished for o in outputs)    # one more step lets the runner drop their state
                if self.on_step is not None:
                    self.on_step(engine, outputs)
        finally:
            self._stopped.set()
            self._abort_all()
            try:
                engine.step()                   # flush the aborted ids to the runner
            finally:
                if self.on_step is not None:
                    self.on_step(engine, [])

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                for rid in payload:
                    self._abort(rid)
            elif kind == "abort_all":
                self._abort_all()
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, q: asyncio.Queue, items: list[tuple[str, SubRequest]]) -> None:
        # Choices of one prompt (n > 1) go in as one group, so they share the prompt's KV blocks.
        groups: dict[tuple[int, ...], list[tuple[str, SubRequest]]] = {}
        for rid, sub in items:
            groups.setdefault(tuple(sub.prompt_token_ids), []).append((rid, sub))
        added = []
        try:
            for group in groups.values():
                rids = [rid for rid, _ in group]
                self.engine.add_group(rids, list(group[0][1].prompt_token_ids), [sub.params for _, sub in group])
                for rid, sub in group:
                    self._routes[rid] = _Route(q, sub.index)
                added.extend(rids)
        except (UserError, ValueError) as e:          # validated on the loop already; a race or a bug
            for rid in added:
                self._abort(rid, notify=False)
            self._post(q.put_nowait, EngineFailure(str(e)))

    def _abort(self, rid: str, notify: bool = True) -> None:
        route = self._routes.pop(rid, None)
        if self.engine.abort(rid) and route is not None and notify:
            self._post(route.queue.put_nowait, Delta(
                route.index, (), "", (), True, "abort", 0, 0, None, ""))

    def _abort_all(self) -> None:
        for rid in list(self._routes):
            self._abort(rid)

    def _fail_all(self, message: str) -> None:
        queues = {id(r.queue): r.queue for r in self._routes.values()}
        for rid in list(self._routes):
            self._abort(rid, notify=False)
        for q in queues.values():
            self._post(q.put_nowait, EngineFailure(message))

    def _post(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:            # the loop has closed (process exit): nobody is listening any more
            pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for o in outputs:
            route = self._routes.get(o.request_id)
            if route is None:
                continue
            if o.error is not None:               # this request alone failed; its HTTP request gets the error
                del self._routes[o.request_id]
                batch.append((route.queue, EngineFailure(f"Request {o.request_id} (choice {route.index}) "
                                                         f"failed in the engine: {o.error}")))
                continue
            batch.append((route.queue, _snapshot(o, route)))
            route.first = False
            if o.finished:
                del self._routes[o.request_id]
        if batch:
            self._post(_put_all, batch)


def _snapshot(o: RequestOutput, route: _Route) -> Delta:
    seq, n = o.seq, len(o.new_token_ids)
    want_lp = seq.params.logprobs is not None
    prompt_lp = tuple(seq.prompt_logprobs) if route.first and seq.params.prompt_logprobs is not None else None
    return Delta(route.index, tuple(o.new_token_ids), o.new_text, tuple(seq.logprobs[-n:]) if want_lp and n else (),
                 o.finished, seq.finish_reason, seq.num_prompt_tokens, len(seq.output_token_ids), prompt_lp,
                 seq.output_text if o.finished else None, seq.num_cached_tokens)


def _put_all(batch: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class RequestStream:
    """The Deltas of one HTTP request's sub-requests, in arrival order. Leaving the `async with` block before every
    sub-request finished (client gone, error, cancellation) aborts the rest, which frees their KV blocks."""

    def __init__(self, owner: AsyncEngine, request_ids: dict[int, str]):
        self.owner, self.request_ids = owner, request_ids      # choice index -> engine request id
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set(request_ids)
        self._watcher: asyncio.Task | None = None

    def watch_disconnect(self, receive: Callable) -> None:
        """Wake the stream when the client hangs up (the ASGI receive channel says http.disconnect)."""
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait(_DISCONNECTED)
        self._watcher = asyncio.ensure_future(watch())

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._open:
            self.owner.abort([self.request_ids[i] for i in self._open])
            self._open.clear()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if not self._open:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _DISCONNECTED:
            raise ClientGone()
        if isinstance(item, EngineFailure):
            raise RuntimeError(item.message)
        if item.finished:
            self._open.discard(item.index)
        return item

"""The engine thread: the only owner of the LLMEngine, shared by every HTTP request (continuous batching).

Handlers on the asyncio loop send commands (add, abort, stop) through a queue; the thread steps the engine while it
has work and hands each output to its request's asyncio queue with call_soon_threadsafe. torch work never runs on
the event loop, and the engine is never touched from two threads.

Outputs are counted in /metrics where they are read (runner.py), since only the reader knows where a stop string cut
a choice; outputs nobody will read (the request is over) are counted here, on the event loop, as they arrive."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.outputs import FinishReason, RequestOutput
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingParams
from blockspec.server.metrics import Metrics
from blockspec.server.protocol import APIError, internal_error

log = logging.getLogger("blockspec.server")


@dataclass
class RequestStream:
    """One HTTP request's engine requests (one per choice) and the queue its outputs arrive on."""

    request_id: str
    queue: asyncio.Queue  # (choice position, RequestOutput) or an APIError that ends the request
    rids: list[str] = field(default_factory=list)  # engine request ids, by choice position; set by the thread
    closed: bool = False  # the HTTP request is over: nobody reads the queue any more
    settled: set[int] = field(default_factory=set)  # choices counted in /metrics up to their end (a stop string)

    async def next(self) -> tuple[int, RequestOutput]:
        item = await self.queue.get()
        if isinstance(item, APIError):
            raise item
        return item

    def count_unread(self, metrics: Metrics, pos: int, out: RequestOutput) -> None:
        """An output of choice `pos` that will not be read: past a stop string its tokens were not answered."""
        if pos in self.settled:
            metrics.count_tokens(0, discarded=len(out.new_token_ids))
        else:
            metrics.record_output(out)


@dataclass
class _Add:
    stream: RequestStream
    work: list[tuple[list[int], SamplingParams]]  # (prompt ids, params) per choice
    accepted: asyncio.Future


@dataclass
class _Abort:
    stream: RequestStream
    position: int | None  # one choice, or None: all of them


class _Stop:
    pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # SimpleQueue.put is safe in a signal handler
        self._owners: dict[str, tuple[RequestStream, int]] = {}  # engine rid -> (stream, choice); thread only
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False

    # ---- event-loop side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    async def submit(self, request_id: str, work: list[tuple[list[int], SamplingParams]]) -> RequestStream:
        """Add one engine request per choice; returns once the engine took them all (or raises APIError)."""
        if self.closing:
            raise shutting_down()
        stream = RequestStream(request_id, asyncio.Queue())
        accepted = asyncio.get_running_loop().create_future()
        self._commands.put(_Add(stream, work, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while the engine was busy: drop what was added
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream, position: int | None = None) -> None:
        """Abort one choice of `stream`, or every one still running (finished ones are left alone)."""
        self._commands.put(_Abort(stream, position))

    def release(self, stream: RequestStream) -> None:
        """The request is over: abort its choices still running; outputs not read, and those still to come, are
        counted as they are."""
        stream.closed = True
        while not stream.queue.empty():
            item = stream.queue.get_nowait()
            if not isinstance(item, APIError):
                stream.count_unread(self.metrics, *item)
        self.abort(stream)

    def _deliver(self, stream: RequestStream, pos: int, out: RequestOutput) -> None:
        """On the event loop: hand `out` to its reader, or count it when there is none any more."""
        if stream.closed:
            stream.count_unread(self.metrics, pos, out)
        else:
            stream.queue.put_nowait((pos, out))

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the running ones; their streams end with finish_reason "abort"."""
        if not self.closing:
            self.closing = True
            self._commands.put(_Stop())

    def join(self, timeout: float | None = None) -> None:
        """Shut down and wait for the thread; call on the event loop."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while not self._commands.empty():  # adds that raced the stop never reached the thread
            cmd = self._commands.get()
            if isinstance(cmd, _Add):
                _settle(cmd.accepted, shutting_down())

    # ---- engine thread

    def _post(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        flush = False  # aborted requests still owe their final output
        while True:
            idle = not self.engine.has_unfinished() and not flush
            try:
                commands = [self._commands.get(block=idle)]
            except queue.Empty:
                commands = []
            while not self._commands.empty():
                commands.append(self._commands.get())
            for cmd in commands:
                if isinstance(cmd, _Add):
                    self._add(cmd)
                elif isinstance(cmd, _Abort):
                    rids = cmd.stream.rids if cmd.position is None else cmd.stream.rids[cmd.position:cmd.position + 1]
                    flush |= self._abort_rids(rids)
            if any(isinstance(cmd, _Stop) for cmd in commands):
                self._abort_rids(list(self._owners))
                self._step()  # delivers the "abort" outputs
                return
            if self.engine.has_unfinished() or flush:
                flush = self._step()

    def _add(self, cmd: _Add) -> None:
        if self.closing:
            self._post(_settle, cmd.accepted, shutting_down())
            return
        if cmd.accepted.cancelled():
            return
        try:
            for pos, (prompt_ids, params) in enumerate(cmd.work):
                rid = self.engine.add_request(prompt_ids, params, request_id=f"{cmd.stream.request_id}-{pos}")
                cmd.stream.rids.append(rid)
                self._owners[rid] = (cmd.stream, pos)
        except Exception as e:
            self._abort_rids(cmd.stream.rids)
            if isinstance(e, BlockspecError):  # e.g. the request does not fit the KV pool
                err = APIError(400, str(e))
            else:
                log.exception("adding request %s failed", cmd.stream.request_id)
                err = internal_error(cmd.stream.request_id)
            self._post(_settle, cmd.accepted, err)
            return
        self._post(_settle, cmd.accepted, None)

    def _abort_rids(self, rids: list[str]) -> bool:
        live = [r for r in rids if r in self._owners]
        for rid in live:
            self.engine.abort(rid)
        return bool(live)

    def _step(self) -> bool:
        """One engine step, outputs delivered; True when requests were aborted and still owe their final output."""
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine cannot say which request broke a step: every request in flight fails, the server lives on.
            log.exception("engine step failed; failing the %d requests in flight", len(self._owners))
            self.metrics.count_error("step")
            owners, self._owners = self._owners, {}
            for rid, (stream, _) in owners.items():
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("abort of %s after a failed step failed", rid)
                self._post(stream.queue.put_nowait, internal_error(stream.request_id))
            return bool(owners)
        stats = self.engine.stats()
        self.metrics.record_step(time.perf_counter() - t0, stats.waiting, stats.running, stats.kv_blocks_used)
        if self.engine.proposer is not None:
            self.metrics.record_draft_lens(self.engine.draft_len.used)
        for out in outputs:
            owner = self._owners.pop(out.request_id, None) if out.finished else self._owners.get(out.request_id)
            if owner is None or out.finish_reason is FinishReason.ERROR:  # nobody will read it: counted here
                self.metrics.record_output(out)
            if owner is not None and out.finish_reason is FinishReason.ERROR:  # the engine failed this request alone
                log.error("request %s failed in the engine: %s", out.request_id, out.error)
                self.metrics.count_error("request")
                siblings = [rid for rid, (st, _) in self._owners.items() if st is owner[0]]  # its other choices
                self._abort_rids(siblings)
                for rid in siblings:
                    del self._owners[rid]
                self._post(owner[0].queue.put_nowait, internal_error(owner[0].request_id))
            elif owner is not None:
                self._post(self._deliver, owner[0], owner[1], out)
        return False


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type_="unavailable")


def _settle(fut: asyncio.Future, error: APIError | None) -> None:
    if fut.done():  # cancelled: the handler already aborted
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)

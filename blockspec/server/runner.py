"""One HTTP request from prepared work to a response: submit to the engine loop, turn outputs into text per choice,
answer as one JSON body or as a server-sent-event stream.

Everything done for one request here (detokenization, stop strings, formatting) is isolated: an exception fails that
request alone (a 500 body, or an error event in its stream), its engine requests are aborted, others carry on."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from blockspec.engine.outputs import FinishReason, StepTrace
from blockspec.server.detok import ChoiceText
from blockspec.server.engine_loop import EngineLoop, RequestStream
from blockspec.server.metrics import Metrics
from blockspec.server.prepare import ModelLimits, Prepared
from blockspec.server.protocol import APIError, internal_error
from blockspec.server.responses import DONE, ResponseFormat, Usage

log = logging.getLogger("blockspec.server")


@dataclass
class ServingState:
    engine_loop: EngineLoop
    limits: ModelLimits
    metrics: Metrics


@dataclass
class Update:
    position: int  # choice index
    text: str  # new final text
    token_ids: list[int]  # new tokens consumed
    finish_reason: FinishReason | None


def _acceptance_upto(lengths: list[int], num_tokens: int) -> list[int]:
    """The verify steps' emitted counts over the first `num_tokens` tokens (the first token is the prefill's, not a
    verify step's): a stop string cut inside a step counts that step's tokens up to the cut only."""
    left, kept = num_tokens - 1, []
    for n in lengths:
        if left <= 0:
            break
        kept.append(min(n, left))
        left -= kept[-1]
    return kept


class _Request:
    def __init__(self, state: ServingState, prepared: Prepared, stream: RequestStream) -> None:
        self.state, self.prepared, self.stream = state, prepared, stream
        self.texts = [ChoiceText(state.limits.tokenizer, prepared.stop) for _ in prepared.choices]
        # per choice, the outputs' deltas accumulated: tokens emitted per verify step and the steps themselves
        self.acceptance: list[list[int]] = [[] for _ in prepared.choices]
        self.steps: list[list[StepTrace]] = [[] for _ in prepared.choices]
        self.reasons: list[FinishReason | None] = [None] * len(prepared.choices)

    async def updates(self) -> AsyncIterator[Update]:
        """Updates per choice until every choice has its finish reason. /metrics counts what is answered: tokens
        and steps past a stop string are the engine's, not the choice's (usage does not count them either)."""
        metrics = self.state.metrics
        while None in self.reasons:
            pos, out = await self.stream.next()
            if self.reasons[pos] is not None:  # the engine's steps after we cut at a stop string, its "abort"
                metrics.count_tokens(0, discarded=len(out.new_token_ids))
                continue
            text = self.texts[pos]
            seen = len(text.token_ids)
            delta, reason = text.push(out.new_token_ids), None
            if out.finished and not text.stopped:
                delta += text.finish()  # may complete a stop string with the last token's held-back bytes
            kept = len(text.token_ids) - seen
            metrics.count_tokens(kept, discarded=len(out.new_token_ids) - kept)
            self.acceptance[pos] += out.new_acceptance_lengths
            self.steps[pos] += out.new_steps
            if text.stopped:
                reason = FinishReason.STOP
                self.acceptance[pos] = _acceptance_upto(self.acceptance[pos], len(text.token_ids))
                self.stream.settled.add(pos)
                self.state.engine_loop.abort(self.stream, pos)
                metrics.record_finished(len(out.prompt_ids), self.acceptance[pos],
                                        self.steps[pos][:len(self.acceptance[pos])])
            elif out.finished:
                reason = out.finish_reason
                metrics.record_finished(len(out.prompt_ids), self.acceptance[pos], self.steps[pos])
            if reason is not None:
                self.reasons[pos] = reason
                metrics.count_finish(reason)  # as answered: a stop string is "stop", whatever the engine
            yield Update(pos, delta, text.token_ids[seen:], reason)

    def close(self) -> None:
        """The request is over (answered, failed or its client gone): choices without a finish reason count as
        aborted, and the engine requests still running are aborted."""
        for pos, reason in enumerate(self.reasons):
            if reason is None:
                self.reasons[pos] = FinishReason.ABORT
                self.state.metrics.count_finish(FinishReason.ABORT)
        self.state.engine_loop.release(self.stream)

    def usage(self) -> Usage:
        return Usage(sum(len(p) for p in self.prepared.prompts), sum(len(t.token_ids) for t in self.texts),
                     self.acceptance)


async def _watch_disconnect(request: Request, stream: RequestStream) -> None:
    """Wakes a waiting non-streaming request when its client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.queue.put_nowait(APIError(499, "the client disconnected"))


def _fail(state: ServingState, request_id: str) -> APIError:
    log.exception("request %s failed", request_id)
    state.metrics.count_error("request")
    return internal_error(request_id)


async def _respond_json(req: _Request, fmt: ResponseFormat, request: Request) -> Response:
    watcher = asyncio.ensure_future(_watch_disconnect(request, req.stream))
    try:
        texts = [""] * len(req.texts)
        reasons: list[FinishReason | None] = [None] * len(req.texts)
        async for u in req.updates():
            texts[u.position] += u.text
            if u.finish_reason is not None:
                reasons[u.position] = u.finish_reason
        body = fmt.response(texts, [t.token_ids for t in req.texts], reasons, req.usage())
    except APIError:
        raise
    except Exception:
        raise _fail(req.state, fmt.request_id) from None
    finally:
        watcher.cancel()
        req.close()
    return JSONResponse(body)


async def _events(req: _Request, fmt: ResponseFormat) -> AsyncIterator[str]:
    try:
        for chunk in fmt.opening_chunks(len(req.texts)):
            yield chunk
        async for u in req.updates():
            if u.text or u.token_ids or u.finish_reason is not None:
                yield fmt.chunk(u.position, u.text, u.token_ids, u.finish_reason)
        if req.prepared.include_usage:
            yield fmt.usage_chunk(req.usage())
    except APIError as e:
        yield fmt.error_chunk(e.body())
    except Exception:
        yield fmt.error_chunk(_fail(req.state, fmt.request_id).body())
    finally:  # also when the client disconnects: the stream is cancelled and its engine requests aborted
        req.close()
    yield DONE


async def run_request(state: ServingState, prepared: Prepared, request: Request, chat: bool) -> Response:
    fmt = ResponseFormat(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", state.limits.name)
    work = [(prepared.prompts[c.prompt_index], c.params) for c in prepared.choices]
    stream = await state.engine_loop.submit(fmt.request_id, work)
    req = _Request(state, prepared, stream)
    if prepared.stream:
        return StreamingResponse(_events(req, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _respond_json(req, fmt, request)

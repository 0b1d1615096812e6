"""The server under load, disconnects and faults, over loopback HTTP.

- 64 concurrent streaming clients (completions and chat) all get complete, uncorrupted outputs equal to their offline
  greedy outputs; the pool is empty afterwards.
- Clients that disconnect midway (streaming, and a non-streaming one that times out) have their engine requests
  aborted and their blocks freed, while the others finish with the right text.
- An exception in one request's own processing fails that request alone (500, or an error event in its stream);
  an engine step that raises fails the requests in flight, and the server serves the next ones."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from blockspec.server import detok
from server_utils import LiveServer, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture
def server(pair):
    _, _, lm, draft = pair
    srv = LiveServer(LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=64)).engine)
    yield srv
    srv.stop()


def assert_pool_empty(srv: LiveServer) -> None:
    srv.wait_idle()
    assert srv.engine.blocks.num_free == srv.engine.pool.num_blocks
    assert all(r == 0 for r in srv.engine.blocks.ref)


def finished_count(srv: LiveServer, reason: str) -> float:
    return srv.app.state.metrics.value("blockspec_finished_requests_total", finish_reason=reason)


async def consume(stream, chat: bool) -> tuple[str, list[int], list[str], set[str]]:
    text, ids, reasons, stream_ids = "", [], [], set()
    async for ch in stream:
        stream_ids.add(ch.id)
        for c in ch.choices:
            assert c.index == 0
            text += (c.delta.content if chat else c.text) or ""
            ids += c.token_ids
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    return text, ids, reasons, stream_ids


def test_64_concurrent_streaming_clients(server, pair):
    _, _, lm, draft = pair
    tok = lm.tokenizer
    n = 64
    chat = [i % 4 == 0 for i in range(n)]
    texts = [f"client {i}: {'abcdefghij'[i % 10] * (1 + i % 5)}" for i in range(n)]
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if c else tok.encode(t)
                  for t, c in zip(texts, chat)]
    max_tokens = [6 + i % 7 for i in range(n)]
    refs = LLM.from_loaded(lm, draft).generate(prompt_ids, [SamplingParams(max_tokens=m) for m in max_tokens],
                                               use_tqdm=False)

    async def one(client, i):
        common = dict(model="tiny", max_tokens=max_tokens[i], temperature=0, stream=True)
        if chat[i]:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": texts[i]}], **common)
        else:
            stream = await client.completions.create(prompt=texts[i], **common)
        return await consume(stream, chat[i])

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(main())
    for i, ((text, ids, reasons, stream_ids), ref) in enumerate(zip(results, refs)):
        assert ids == ref.token_ids, i
        assert text == tok.decode(ref.token_ids), i
        assert reasons == [ref.finish_reason], i
        assert len(stream_ids) == 1, i
    assert len({s for r in results for s in r[3]}) == n  # one id per request
    # batched across clients: one request at a time would take at least sum(max_tokens) = 573 steps
    assert server.app.state.metrics.value("blockspec_step_latency_seconds_count") < 150
    assert_pool_empty(server)


def test_disconnected_clients_free_their_blocks(server, pair):
    _, _, lm, draft = pair
    prompts = [f"stay {i}" for i in range(6)]
    refs = LLM.from_loaded(lm, draft).generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)

    async def leave_early(client, i):
        stream = await client.completions.create(model="tiny", prompt=f"leave {i}", max_tokens=400, temperature=0,
                                                 stream=True)
        got = 0
        async for ch in stream:
            got += sum(len(c.token_ids) for c in ch.choices)
            if got >= 3:
                break
        await stream.close()
        return got

    async def stay(client, i):
        stream = await client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0,
                                                 stream=True)
        return await consume(stream, chat=False)

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(leave_early(client, i) for i in range(8)),
                                        *(stay(client, i) for i in range(6)))

    results = asyncio.run(main())
    assert all(got >= 3 for got in results[:8])
    for (text, ids, reasons, _), ref in zip(results[8:], refs):
        assert ids == ref.token_ids and reasons == [ref.finish_reason]
    # a non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={"model": "tiny", "prompt": "slow", "max_tokens": 480, "temperature": 0})
    assert_pool_empty(server)
    assert finished_count(server, "abort") == 9
    assert finished_count(server, "length") == 6


def test_internal_error_fails_one_request_alone(server, pair, monkeypatch):
    _, _, lm, draft = pair
    original = detok.ChoiceText.push

    def push(self, ids):  # the fault: any request with stop=["BOOM"]
        if self.stop == ["BOOM"] and len(self.token_ids) >= 2:
            raise RuntimeError("injected fault")
        return original(self, ids)

    monkeypatch.setattr(detok.ChoiceText, "push", push)
    prompts = [f"fine {i}" for i in range(6)]
    refs = LLM.from_loaded(lm, draft).generate(prompts, SamplingParams(max_tokens=30), use_tqdm=False)

    async def faulty(client, stream: bool):
        r = await client.completions.create(model="tiny", prompt="doomed", max_tokens=200, temperature=0,
                                            stop=["BOOM"], stream=stream)
        if stream:
            await consume(r, chat=False)

    async def fine(client, i):
        return await consume(await client.completions.create(model="tiny", prompt=prompts[i], max_tokens=30,
                                                             temperature=0, stream=True), chat=False)

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(faulty(client, False), faulty(client, True),
                                        *(fine(client, i) for i in range(6)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], openai.InternalServerError) and results[0].status_code == 500
    assert "internal error while serving request cmpl-" in results[0].message
    assert isinstance(results[1], openai.APIError) and "internal error while serving request cmpl-" in str(results[1])
    for (text, ids, reasons, _), ref in zip(results[2:], refs):
        assert ids == ref.token_ids and reasons == [ref.finish_reason]
    assert server.app.state.metrics.value("blockspec_errors_total", kind="request") == 2
    assert_pool_empty(server)  # the failed requests' engine requests were aborted
    assert finished_count(server, "abort") == 2


def test_engine_failure_in_one_request_fails_it_alone(server, pair, monkeypatch):
    from blockspec.engine.llm_engine import LLMEngine

    _, _, lm, draft = pair
    doomed = [5, 6, 7, 8, 9]
    original = LLMEngine.commit

    def commit(self, result):  # the fault: the engine's bookkeeping of one request raises mid-generation
        if result.seq.prompt_ids == doomed and len(result.seq.output_ids) >= 2:
            raise RuntimeError("injected engine fault")
        return original(self, result)

    monkeypatch.setattr(LLMEngine, "commit", commit)
    prompts = [f"fine {i}" for i in range(4)]
    refs = LLM.from_loaded(lm, draft).generate(prompts, SamplingParams(max_tokens=30), use_tqdm=False)
    errors_before = server.app.state.metrics.value("blockspec_errors_total", kind="request")

    async def main():
        async with server.async_client(timeout=120) as client:
            doomed_req = client.completions.create(model="tiny", prompt=doomed, max_tokens=100, temperature=0, n=2)
            fine = [client.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0, stream=True)
                    for p in prompts]
            results = await asyncio.gather(doomed_req, *fine, return_exceptions=True)
            return [results[0]] + [await consume(r, chat=False) for r in results[1:]]

    results = asyncio.run(main())
    assert isinstance(results[0], openai.InternalServerError) and results[0].status_code == 500
    for (text, ids, reasons, _), ref in zip(results[1:], refs):
        assert ids == ref.token_ids and reasons == [ref.finish_reason]
    assert server.app.state.metrics.value("blockspec_errors_total", kind="request") == errors_before + 1
    assert_pool_empty(server)  # the failed choice finished in the engine, its sibling choice was aborted


def test_failed_engine_step_fails_requests_in_flight_and_serving_goes_on(server, monkeypatch):
    engine = server.engine
    real_step = engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    client = server.client()
    with pytest.raises(openai.InternalServerError, match="internal error while serving request"):
        client.completions.create(model="tiny", prompt="first", max_tokens=40, temperature=0)
    assert_pool_empty(server)
    ok = client.completions.create(model="tiny", prompt="second", max_tokens=5, temperature=0)
    assert len(ok.choices[0].token_ids) == 5
    assert server.app.state.metrics.value("blockspec_errors_total", kind="step") == 1


def test_shutdown_aborts_in_flight_and_refuses_new(pair):
    _, _, lm, draft = pair
    srv = LiveServer(LLM.from_loaded(lm, draft).engine)
    loop = srv.app.state.engine_loop

    async def main():
        async with srv.async_client(timeout=60) as client:
            streams = [await client.completions.create(model="tiny", prompt=f"long {i}", max_tokens=480,
                                                       temperature=0, stream=True) for i in range(3)]
            firsts = [await s.__anext__() for s in streams]  # all three are generating
            assert all(f.choices for f in firsts)
            loop.begin_shutdown()  # what SIGINT/SIGTERM does first (cli/serve.py's handle_exit)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model="tiny", prompt="late", max_tokens=2)
            assert refused.value.status_code == 503
            return [await consume(s, chat=False) for s in streams]

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert all(reasons == ["abort"] for _, _, reasons, _ in results)
    assert all(len(ids) < 470 for _, ids, _, _ in results)
    srv.stop()
    assert time.monotonic() - t0 < 30
    assert not loop._thread.is_alive()
    assert srv.engine.blocks.num_free == srv.engine.pool.num_blocks

"""Server hardening, over loopback HTTP (the official `openai` client where it applies):

- `null` for an optional request field means its default, as OpenAI's clients send it for parameters set to None.
- A request body over the limit gets 413 (OpenAI's error body) without being read whole, whether its size is
  declared (Content-Length) or not (chunked).
- Prompts are tokenized off the event loop: while a slow tokenization is in progress /health answers at once and a
  whole streamed request is served.
- Stop strings: usage.acceptance covers the tokens up to the stop string only, and /metrics counts the choice as
  "stop" (also when the engine finished the request in the same step); steps emit several tokens each here
  (ForcedAcceptance, whose outputs are the target's greedy tokens).

Lone surrogates, the KV-pool 400's param and /v1/models' max_model_len are in test_server_errors.py, the Bearer
scheme in test_server.py, the 503 after SIGTERM in test_server_cli.py, a tiny top_p in test_top_p_underflow.py."""

from __future__ import annotations

import http.client
import threading
import time

import httpx
import openai
import pytest

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import ForcedAcceptance
from server_utils import LiveServer, tiny_pair

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def server(pair):
    _, _, lm, draft = pair
    srv = LiveServer(LLM.from_loaded(lm, draft).engine, max_request_bytes=LIMIT)
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------------------------------------
# null is the default


def test_null_means_the_default(server):
    client = server.client()
    common = dict(model="tiny", prompt="Hello", max_tokens=12, seed=3)
    explicit = client.completions.create(temperature=1.0, top_p=1.0, n=1, stream=False, presence_penalty=0.0,
                                         **common)
    nulls = client.completions.create(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None,
                                      logprobs=None, frequency_penalty=None, stop=None, user=None, **common)
    assert len(nulls.choices) == 1 and nulls.choices[0].token_ids == explicit.choices[0].token_ids
    greedy = client.completions.create(temperature=0, **common)
    assert explicit.choices[0].token_ids != greedy.choices[0].token_ids  # null temperature is 1.0, not greedy
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=3, temperature=None,
                                          top_p=None, n=None, stream=None, presence_penalty=None, logprobs=None)
    chat_explicit = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=3)
    assert chat.choices[0].message.content == chat_explicit.choices[0].message.content
    # every optional field of both endpoints as null, raw
    optional = ["max_tokens", "n", "stop", "temperature", "top_p", "top_k", "seed", "stream", "stream_options",
                "stop_token_ids", "user", "presence_penalty", "frequency_penalty", "logit_bias"]
    completion = {k: None for k in optional + ["logprobs", "echo", "suffix", "best_of"]}
    # a null seed samples at random, so a draw may meet EOS (as early as its 16th token): a draw that stops on
    # length has the default max_tokens (16), any other one stopped on EOS within them; some of a few draws do
    reasons = []
    for _ in range(5):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", **completion})
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        n, reason = len(choice["token_ids"]), choice["finish_reason"]
        assert (reason == "length" and n == 16) or (reason == "stop" and 1 <= n <= 16), (reason, n)
        reasons.append(reason)
    assert "length" in reasons, reasons
    chat_body = {k: None for k in optional + ["max_completion_tokens", "logprobs", "top_logprobs"]}
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi", "name": None}], **chat_body,
                         "max_tokens": 4, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"usage"' not in r.text
    # a required field stays required
    r = httpx.post(server.url + "/v1/completions", json={"model": None, "prompt": "Hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ------------------------------------------------------------------------------------------------------------------
# body limit


def too_large_error() -> dict:
    return {"message": f"the request body is larger than {LIMIT} bytes, the limit of this server (blockspec serve "
                       f"--max-request-bytes)", "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}


def test_body_over_the_limit_is_413(server):
    with pytest.raises(openai.APIStatusError) as e:
        server.client().completions.create(model="tiny", prompt="a" * LIMIT, max_tokens=2)
    assert e.value.status_code == 413 and e.value.response.json() == {"error": too_large_error()}
    ok = server.client().completions.create(model="tiny", prompt=[1] * 40, max_tokens=2)  # under it: served
    assert len(ok.choices[0].token_ids) == 2


def send_partial(port: int, headers: dict[str, str], body_part: bytes) -> http.client.HTTPResponse:
    """POST /v1/completions sending only `body_part` of the body, then read the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # the server waiting for the rest: a timeout
    conn.putrequest("POST", "/v1/completions")
    for k, v in {"Content-Type": "application/json", **headers}.items():
        conn.putheader(k, v)
    conn.endheaders()
    conn.send(body_part)
    return conn.getresponse()


def test_body_over_the_limit_is_refused_without_reading_it(server):
    # declared: answered from Content-Length, although only 1 kB of the 100 MB ever arrives
    r = send_partial(server.port, {"Content-Length": str(100 * 2**20)}, b'{"model": "tiny", "prompt": "' + b"a" * 1024)
    assert r.status == 413 and httpx.Response(413, content=r.read()).json() == {"error": too_large_error()}
    # not declared (chunked): answered once the chunks received pass the limit, the last chunk never sent
    chunk = b"a" * 16384
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 1))
    r = send_partial(server.port, {"Transfer-Encoding": "chunked"}, chunks)
    assert r.status == 413 and httpx.Response(413, content=r.read()).json() == {"error": too_large_error()}
    assert server.client().models.list().data[0].id == "tiny"  # still serving


# ------------------------------------------------------------------------------------------------------------------
# tokenization off the event loop


class SlowTokenizer:
    """The real tokenizer whose encode takes `delay` seconds (time.sleep, as a long prompt's tokenization would
    hold the thread that runs it), and says when it started and ended."""

    def __init__(self, tok, delay: float) -> None:
        self.tok, self.delay = tok, delay
        self.started, self.window = threading.Event(), [0.0, 0.0]

    def encode(self, text: str) -> list[int]:
        self.window[0] = time.monotonic()
        self.started.set()
        time.sleep(self.delay)
        self.window[1] = time.monotonic()
        return self.tok.encode(text)

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


def test_health_and_streams_are_served_while_a_prompt_is_tokenized(server, pair, monkeypatch):
    tok = pair[2].tokenizer
    slow = SlowTokenizer(tok, delay=2.0)
    monkeypatch.setattr(server.app.state.limits, "tokenizer", slow)
    client = server.client(timeout=60)
    result: dict = {}
    slow_request = threading.Thread(target=lambda: result.update(r=client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0)))
    slow_request.start()
    assert slow.started.wait(10)
    chunk_times: list[float] = []

    def stream() -> None:  # token ids: no tokenizer needed, only the event loop and the engine
        for _ in client.completions.create(model="tiny", prompt=[1, 40, 50], max_tokens=100, temperature=0,
                                           stream=True):
            chunk_times.append(time.monotonic())

    streamer = threading.Thread(target=stream)
    streamer.start()
    latencies = []
    while not slow.window[1]:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    streamer.join(60)
    slow_request.join(30)
    assert len(latencies) >= 5 and max(latencies) < 0.5, latencies  # on the loop: one answer after ~2 s
    start, end = slow.window
    assert chunk_times and all(start < t < end for t in chunk_times)  # a whole stream, served meanwhile
    ref = LLM.from_loaded(pair[2], pair[3]).generate(["Hello"], SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert result["r"].choices[0].token_ids == ref.token_ids


# ------------------------------------------------------------------------------------------------------------------
# stop strings: acceptance and metrics


def acceptance_upto(lengths: list[int], num_tokens: int) -> list[int]:
    """Steps covering the first num_tokens tokens (the first is the prefill's); the last one cut there."""
    out, left = [], num_tokens - 1
    for n in lengths:
        if left > 0:
            out.append(min(n, left))
            left -= out[-1]
    return out


def test_stop_strings_cut_acceptance_and_count_as_stop(pair):
    _, _, lm, draft = pair
    tok = lm.tokenizer
    forced = ForcedAcceptance(4.0)  # K = 3: every step emits 4 tokens
    prompts = ["Hello", "The quick brown fox", "abc"]
    refs = LLM.from_loaded(lm, draft, forced).generate(prompts, SamplingParams(max_tokens=30), use_tqdm=False)
    assert all(set(r.acceptance_lengths[:-1]) == {4} for r in refs)
    srv = LiveServer(LLM.from_loaded(lm, draft, forced).engine)
    try:
        client = srv.client()
        cases = 0
        for prompt, ref in zip(prompts, refs):
            text = tok.decode(ref.token_ids)

            def completed_by(stop: str) -> int:  # tokens up to the one that completes the stop string
                return next(k for k in range(len(ref.token_ids)) if stop in tok.decode(ref.token_ids[:k]))

            # a 2-character stop string first found at i, completed in the middle of a step
            i = next(i for i in range(3, len(text) - 2)
                     if text.find(text[i:i + 2]) == i and (completed_by(text[i:i + 2]) - 1) % 4)
            stop, n = text[i:i + 2], completed_by(text[i:i + 2])
            want = acceptance_upto(ref.acceptance_lengths, n)
            assert sum(want) == n - 1 < sum(ref.acceptance_lengths[:len(want)])  # that step went past the stop
            for max_tokens in (30, n):  # n: the engine finishes ("length") in the step that completes the stop string
                resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stop=stop)
                c = resp.choices[0]
                assert (c.text, c.finish_reason, c.token_ids) == (text[:i], "stop", ref.token_ids[:n])
                assert resp.usage.acceptance["acceptance_lengths"] == [want]
                assert resp.usage.acceptance["num_verify_steps"] == len(want)
                chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, stop=stop, stream=True,
                                                        stream_options={"include_usage": True}))
                assert chunks[-1].usage.acceptance["acceptance_lengths"] == [want]
                assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "stop"
                cases += 2
        srv.wait_idle()
        metrics = srv.app.state.metrics
        counted = {r: metrics.value("blockspec_finished_requests_total", finish_reason=r)
                   for r in ("stop", "length", "abort")}
        assert counted == {"stop": cases, "length": 0, "abort": 0}
    finally:
        srv.stop()

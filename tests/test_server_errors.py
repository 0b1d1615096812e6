"""Bad input never yields a 5xx: every malformed or invalid request gets 400 with an OpenAI-style error body that
names the field, with the exact message asserted; then hypothesis fuzzes request bodies (random JSON, mutated valid
bodies, raw bytes) against both endpoints, bounded in examples and deterministic, and every answer must be a 200 with
a well-formed body or a 400 with a well-formed error.

The server runs with a 64-token context and a 48-slot KV pool, so that context and pool limits are easy to hit and
every fuzzed generation is short."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from server_utils import LiveServer, tiny_pair

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}


@pytest.fixture(scope="module")
def server():
    _, _, lm, draft = tiny_pair()
    srv = LiveServer(LLM.from_loaded(lm, draft,
                                     engine=EngineConfig(max_model_len=64, num_kv_blocks=3, block_size=16)).engine)
    yield srv
    srv.stop()


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def with_(path: str, **fields) -> dict:
    body = dict(BASE[path])
    for k, v in fields.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


DROP = object()
TOO_LONG = "a" * 70  # 71 tokens with BOS: over the 64-token context
CASES = [  # (path, body, param, message)
    (COMPLETIONS, b'{"model": ', None,
     "the request body is not valid JSON (Expecting value: line 1 column 11 (char 10))"),
    (COMPLETIONS, b"[1, 2]", None, "the request body must be a JSON object, got list"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "a", "temperature": NaN}', None,
     "the request body is not valid JSON (NaN is not valid JSON)"),
    (COMPLETIONS, b"\xff\xfe", None, "the request body is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (COMPLETIONS, with_(COMPLETIONS, model=DROP), "model", "missing required field 'model'"),
    (COMPLETIONS, with_(COMPLETIONS, model=5), "model", "invalid value for 'model': Input should be a valid string (got 5)"),
    (COMPLETIONS, with_(COMPLETIONS, model="gpt-4"), "model",
     "model 'gpt-4' is not served here; this server serves 'tiny'"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=DROP), "prompt", "missing required field 'prompt'"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens="10"), "max_tokens",
     "invalid value for 'max_tokens': Input should be a valid integer (got \"10\")"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens=2.0), "max_tokens",
     "invalid value for 'max_tokens': Input should be a valid integer (got 2.0)"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens=-5), "max_tokens", "max_tokens=-5 must be >= 1"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens=0), "max_tokens", "max_tokens=0 must be >= 1"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens=10**30), "max_tokens",
     f"max_tokens={10**30} is too large: the prompt has 3 tokens and the context is 64 tokens, so at most 61 can "
     f"be generated"),
    (COMPLETIONS, with_(COMPLETIONS, max_tokens=50), "max_tokens",
     "the request needs up to 57 KV slots (prompt 3 + max_tokens 50 + 4 verify slots) but the KV pool holds 48 "
     "(num_kv_blocks x block_size); raise num_kv_blocks / kv_cache_tokens or lower max_tokens"),
    (CHAT, with_(CHAT, max_tokens=DROP, max_completion_tokens=30), "max_completion_tokens",
     "the request needs up to 54 KV slots (prompt 20 + max_completion_tokens 30 + 4 verify slots) but the KV pool "
     "holds 48 (num_kv_blocks x block_size); raise num_kv_blocks / kv_cache_tokens or lower max_completion_tokens"),
    (COMPLETIONS, with_(COMPLETIONS, prompt="a" * 44, max_tokens=DROP), "prompt",  # not even the default fits
     "the request needs up to 50 KV slots (prompt 45 + max_tokens 1 + 4 verify slots) but the KV pool holds 48 "
     "(num_kv_blocks x block_size); raise num_kv_blocks / kv_cache_tokens or shorten the prompt"),
    (COMPLETIONS, with_(COMPLETIONS, prompt="a\ud800b"), "prompt",
     "prompt contains a lone UTF-16 surrogate ('\\ud800' at character 1), which is not valid Unicode text"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=["fine", "x\udfff"]), "prompt.1",
     "prompt.1 contains a lone UTF-16 surrogate ('\\udfff' at character 1), which is not valid Unicode text"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=TOO_LONG), "prompt",
     "the prompt has 71 tokens but the model's context is 64 tokens (max_position_embeddings); shorten the prompt"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=[]), "prompt",
     "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=[True, 3]), "prompt",
     "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=[[]]), "prompt", "the prompt is empty: pass at least one token"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=[1, 999]), "prompt",
     "prompt token id 999 is outside the vocabulary [0, 128)"),
    (COMPLETIONS, with_(COMPLETIONS, temperature=-1), "temperature",
     "invalid sampling value temperature=-1.0: must be a finite number >= 0 (0 means greedy)"),
    (COMPLETIONS, with_(COMPLETIONS, top_p=0), "top_p", "invalid sampling value top_p=0.0: must be in (0, 1]"),
    (COMPLETIONS, with_(COMPLETIONS, top_p=1.5), "top_p", "invalid sampling value top_p=1.5: must be in (0, 1]"),
    (COMPLETIONS, with_(COMPLETIONS, top_k=-2), "top_k",
     "invalid sampling value top_k=-2: must be an integer >= 0 (0 or -1 disables it)"),
    (COMPLETIONS, with_(COMPLETIONS, n=0), "n", "invalid value for 'n': Input should be greater than or equal to 1 (got 0)"),
    (COMPLETIONS, with_(COMPLETIONS, n=1000), "n",
     "invalid value for 'n': Input should be less than or equal to 128 (got 1000)"),
    (COMPLETIONS, with_(COMPLETIONS, prompt=["a", "b", "c"], n=100), "n",
     "3 prompts x n=100 choices is more than 256 in one request"),
    (COMPLETIONS, with_(COMPLETIONS, seed=-1), "seed",
     "invalid value for 'seed': Input should be greater than or equal to 0 (got -1)"),
    (COMPLETIONS, with_(COMPLETIONS, stop=""), "stop", "stop must be a non-empty string or a list of non-empty strings"),
    (COMPLETIONS, with_(COMPLETIONS, stop=[1]), "stop", "stop must be a non-empty string or a list of non-empty strings"),
    (COMPLETIONS, with_(COMPLETIONS, stop=["x"] * 17), "stop", "stop has 17 strings; at most 16 are allowed"),
    (COMPLETIONS, with_(COMPLETIONS, stop_token_ids=[128]), "stop_token_ids",
     "stop_token_ids contains 128, outside the vocabulary [0, 128)"),
    (COMPLETIONS, with_(COMPLETIONS, logprobs=1), "logprobs",
     "logprobs is not supported by blockspec; leave it out (see docs/serving.md)"),
    (COMPLETIONS, with_(COMPLETIONS, echo=True), "echo",
     "echo is not supported by blockspec; leave it out (see docs/serving.md)"),
    (COMPLETIONS, with_(COMPLETIONS, best_of=2), "best_of",
     "best_of is not supported by blockspec; leave it out (see docs/serving.md)"),
    (COMPLETIONS, with_(COMPLETIONS, presence_penalty=0.5), "presence_penalty",
     "presence_penalty is not supported by blockspec; leave it out (see docs/serving.md)"),
    (COMPLETIONS, with_(COMPLETIONS, stream="yes"), "stream",
     "invalid value for 'stream': Input should be a valid boolean (got \"yes\")"),
    (COMPLETIONS, with_(COMPLETIONS, stream_options={"include_usage": True}), "stream_options",
     "stream_options is only allowed with stream: true"),
    (COMPLETIONS, with_(COMPLETIONS, foo=1), "foo", "unsupported request field 'foo'"),
    (CHAT, with_(CHAT, messages=[]), "messages", "messages must not be empty"),
    (CHAT, with_(CHAT, messages="hi"), "messages",
     "invalid value for 'messages': Input should be a valid list (got \"hi\")"),
    (CHAT, with_(CHAT, messages=[{"role": "user"}]), "messages.0.content", "missing required field 'messages.0.content'"),
    (CHAT, with_(CHAT, messages=[{"role": "robot", "content": "x"}]), "messages.0.role",
     "invalid value for 'messages.0.role': Input should be 'system', 'developer', 'user' or 'assistant' (got \"robot\")"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": 5}]), "messages.0.content",
     "messages[0].content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (only text is "
     "supported)"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
     "messages.0.content", "messages[0].content must be a string or a list of {\"type\": \"text\", \"text\": ...} "
                           "parts (only text is supported)"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content",
     "messages.0.content contains a lone UTF-16 surrogate ('\\ud800' at character 1), which is not valid Unicode "
     "text"),
    (CHAT, with_(CHAT, messages=[{"role": "system", "content": "ok"},
                                 {"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
     "messages.1.content",
     "messages.1.content contains a lone UTF-16 surrogate ('\\udc00' at character 0), which is not valid Unicode "
     "text"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": TOO_LONG}]), "messages",
     "the prompt has 88 tokens but the model's context is 64 tokens (max_position_embeddings); shorten the prompt"),
    (CHAT, with_(CHAT, max_completion_tokens=-1), "max_completion_tokens", "max_completion_tokens=-1 must be >= 1"),
    (CHAT, with_(CHAT, logprobs=True), "logprobs",
     "logprobs is not supported by blockspec; leave it out (see docs/serving.md)"),
    (CHAT, with_(CHAT, tools=[]), "tools", "unsupported request field 'tools'"),
]


@pytest.mark.parametrize("path,body,param,message", CASES, ids=[f"{i}-{c[0][4:]}" for i, c in enumerate(CASES)])
def test_bad_input_is_400_naming_the_field(server, path, body, param, message):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "model_not_found" if param == "model" and "served" in message else None}}


def test_models_advertise_the_length_the_pool_holds(server):
    # 48 KV slots, 4 of them for the verify window: 44 tokens of prompt + completion, less than the 64-token context
    assert [(m.id, m.max_model_len) for m in server.client().models.list().data] == [("tiny", 44)]
    assert post(server, COMPLETIONS, with_(COMPLETIONS, prompt=[1] * 40, max_tokens=4)).status_code == 200
    over = post(server, COMPLETIONS, with_(COMPLETIONS, prompt=[1] * 40, max_tokens=5))
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"] == {"message": "Not Found", "type": "not_found_error",
                                                          "param": None, "code": None}
    r = httpx.get(server.url + COMPLETIONS)
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"


# ------------------------------------------------------------------------------------------------------------------
# fuzzing

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "temperature", "top_p",
          "top_k", "seed", "stream", "stream_options", "stop_token_ids", "logprobs", "echo", "user"]


# values near the valid ones (small and negative numbers, short strings, id lists) as well as arbitrary JSON
NEAR = (st.integers(-3, 80) | st.integers() | st.floats(-3, 3) | st.text(max_size=6) | st.booleans() | st.none()
        | st.lists(st.integers(-2, 200), max_size=5) | st.lists(st.text(max_size=4), max_size=3))


def mutated(path: str):
    """A valid body with a few fields set to other values or removed."""
    keys = st.sampled_from(FIELDS) | st.sampled_from(FIELDS) | st.text(max_size=8)  # mostly known fields
    edits = st.dictionaries(keys, NEAR | NEAR | JSON | st.just(DROP), max_size=3)
    return edits.map(lambda e: with_(path, **e))


def check_answer(r: httpx.Response, stream: bool) -> None:
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error" and (err["param"] is None or isinstance(err["param"], str))
        return
    if not stream:
        body = r.json()
        assert body["choices"] and body["usage"]["total_tokens"] >= 1
        return
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from([COMPLETIONS, CHAT]), data=st.data())
def test_fuzzed_bodies_never_5xx(server, path, data):
    body = data.draw(mutated(path) | mutated(path) | mutated(path) | JSON | st.binary(max_size=40))
    r = post(server, path, body)
    check_answer(r, stream=isinstance(body, dict) and body.get("stream") is True)

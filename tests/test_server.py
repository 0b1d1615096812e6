"""The OpenAI-compatible server, driven over loopback HTTP by the official `openai` client, against `LLM.generate`
on the same tiny target + random DFlash drafter (fp32, CPU).

- /v1/completions with string, string-list, token-id and token-id-list prompts; /v1/chat/completions through the
  model's chat template; streaming and not: text, token ids, finish reasons and acceptance lengths equal the
  offline engine's, usage counts the prompt and generated tokens.
- Stop strings cut the text before their first occurrence (also across chunks) and finish with "stop".
- Seeded sampling is reproducible and equals LLM.generate with the same seed; choice j of n uses seed + j.
- /v1/models, /health; an API key makes every path answer 401 without it (with `WWW-Authenticate: Bearer`); the
  Bearer scheme is case-insensitive."""

from __future__ import annotations

import httpx
import openai
import pytest

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from server_utils import LiveServer, tiny_pair

PROMPTS = ["Hello", "The quick brown fox", "abc", "1234", "Once upon a time", "x"]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def server(pair):
    _, _, lm, draft = pair
    srv = LiveServer(LLM.from_loaded(lm, draft).engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(pair):
    _, _, lm, draft = pair
    return LLM.from_loaded(lm, draft)


def reference(offline: LLM, prompts, **params):
    return offline.generate(prompts, SamplingParams(**params), use_tqdm=False)


def stream_text(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], object]:
    """Joined text and finish reason per choice index, and the usage chunk, from a stream of chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            assert ch.choices == []
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if chat else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                assert c.index not in reasons, "two finish reasons for one choice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_completions_equal_llm_generate(server, offline, pair):
    tok = pair[2].tokenizer
    refs = reference(offline, PROMPTS, max_tokens=20)
    client = server.client()
    batch = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    for c, ref in zip(batch.choices, refs):
        assert c.text == tok.decode(ref.token_ids)
        assert c.token_ids == ref.token_ids
        assert c.finish_reason == ref.finish_reason
    assert batch.usage.prompt_tokens == sum(len(r.prompt_ids) for r in refs)
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens
    assert batch.usage.acceptance["acceptance_lengths"] == [r.acceptance_lengths for r in refs]
    steps = [a for r in refs for a in r.acceptance_lengths]
    assert batch.usage.acceptance["num_verify_steps"] == len(steps)
    assert batch.usage.acceptance["mean_acceptance_length"] == pytest.approx(sum(steps) / len(steps))
    one = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0)
    assert one.choices[0].text == batch.choices[1].text and one.choices[0].token_ids == refs[1].token_ids


def test_token_id_prompts(server, offline):
    ids = [[1, 40, 50, 60], [1, 7, 8], [5]]
    refs = reference(offline, ids, max_tokens=10)
    client = server.client()
    many = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert [c.token_ids for c in many.choices] == [r.token_ids for r in refs]
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=10, temperature=0)
    assert one.choices[0].token_ids == refs[0].token_ids
    assert one.usage.prompt_tokens == 4


def test_streaming_completions_equal_non_streaming(server, offline, pair):
    tok = pair[2].tokenizer
    refs = reference(offline, PROMPTS[:3], max_tokens=16)
    chunks = list(server.client().completions.create(
        model="tiny", prompt=PROMPTS[:3], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    texts, reasons, usage = stream_text(chunks, chat=False)
    assert texts == {i: tok.decode(r.token_ids) for i, r in enumerate(refs)}
    assert reasons == {i: r.finish_reason for i, r in enumerate(refs)}
    assert usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert usage.acceptance["acceptance_lengths"] == [r.acceptance_lengths for r in refs]
    ids = {}
    for ch in chunks:
        for c in ch.choices:
            ids.setdefault(c.index, []).extend(c.token_ids)
    assert ids == {i: r.token_ids for i, r in enumerate(refs)}
    without_usage = list(server.client().completions.create(model="tiny", prompt="abc", max_tokens=4,
                                                           temperature=0, stream=True))
    assert all(ch.usage is None for ch in without_usage)


def test_chat_uses_the_template_streaming_and_not(server, offline, pair):
    tok = pair[2].tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode("<system>Be brief.\n<user>Hi there\n<assistant>")[1:]  # the template has no BOS
    ref = reference(offline, [ids], max_tokens=15)[0]
    client = server.client()
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == tok.decode(ref.token_ids)
    assert resp.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=15,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, usage = stream_text(chunks, chat=True)
    assert texts == {0: resp.choices[0].message.content} and reasons == {0: ref.finish_reason}
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(ref.token_ids)
    parts = client.chat.completions.create(model="tiny", max_tokens=15, temperature=0, messages=[
        messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == resp.choices[0].message.content


def _stop_case(tok, ref) -> tuple[str, str]:
    """A two-character stop string that first occurs in the middle of the reference text, and the expected text."""
    text = tok.decode(ref.token_ids)
    for i in range(3, len(text) - 2):
        stop = text[i:i + 2]
        if text.find(stop) == i:
            return stop, text[:i]
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, offline, pair, stream):
    tok = pair[2].tokenizer
    refs = reference(offline, PROMPTS[:4], max_tokens=24)
    client = server.client()
    for prompt, ref in zip(PROMPTS[:4], refs):
        stop, expected = _stop_case(tok, ref)
        never = "\u2603never"  # not in the vocabulary: never matches, holds nothing back at the end
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         stop=[never, stop], stream=stream)
        if stream:
            texts, reasons, _ = stream_text(resp, chat=False)
            assert texts == {0: expected} and reasons == {0: "stop"}
        else:
            assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
            # token ids up to the one that completed the stop string
            assert resp.choices[0].token_ids == ref.token_ids[:len(expected) + 2]
    server.wait_idle()  # the engine requests cut by stop strings were aborted


def test_stop_token_ids(server, offline):
    ref = reference(offline, ["Hello"], max_tokens=20)[0]
    stop_id = ref.token_ids[5]
    cut = ref.token_ids[:ref.token_ids.index(stop_id) + 1]
    resp = server.client().completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0,
                                              extra_body={"stop_token_ids": [stop_id]})
    assert resp.choices[0].token_ids == cut and resp.choices[0].finish_reason == "stop"


def test_seeds_reproducible_and_equal_offline(server, offline, pair):
    tok = pair[2].tokenizer
    client = server.client()

    def sample(seed, n=1):
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed, n=n, extra_body={"top_k": 50})

    a, b = sample(7), sample(7)
    assert a.choices[0].text == b.choices[0].text
    ref = reference(offline, ["Hello"], max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)[0]
    assert a.choices[0].token_ids == ref.token_ids and a.choices[0].text == tok.decode(ref.token_ids)
    assert len({sample(s).choices[0].text for s in (1, 2, 3)}) > 1
    three = sample(7, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for j, c in enumerate(three.choices):  # choice j is seeded with seed + j
        assert c.token_ids == reference(offline, ["Hello"], max_tokens=16, temperature=1.0, top_p=0.9, top_k=50,
                                        seed=7 + j)[0].token_ids
    assert three.usage.prompt_tokens == len(ref.prompt_ids)  # the prompt counts once


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].max_model_len == 512
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_api_key(pair):
    _, _, lm, _ = pair
    srv = LiveServer(LLM.from_loaded(lm).engine, api_key="s3cret")
    try:
        for path in ("/health", "/metrics", "/v1/models", "/nowhere"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            for wrong in ("Bearer wrong", "Basic s3cret", "Bearer", "s3cret", "Bearer s3cret2"):
                r = httpx.get(srv.url + path, headers={"Authorization": wrong})
                assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", wrong
        for scheme in ("bearer", "BEARER", "BeArEr"):  # the scheme is case-insensitive, the key is not
            assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
            assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"{scheme} S3CRET"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").completions.create(model="tiny", prompt="a", max_tokens=2)
        ok = srv.client(api_key="s3cret").completions.create(model="tiny", prompt="a", max_tokens=2)
        assert len(ok.choices[0].token_ids) == 2
        assert httpx.get(srv.url + "/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        srv.stop()

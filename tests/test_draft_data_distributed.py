"""`torchrun ... -m blockspec draft-data`: the ranks generate alternate chunks of the prompts and rank 0 merges the
chunks' manifests and shards into exactly the data one process writes (CPU, gloo, two ranks)."""

from __future__ import annotations

import itertools

from blockspec.cli import main
from blockspec.data.shards import read_manifest, read_shards
from launch_utils import torchrun
from test_data_builder import WORDS
from test_data_builder import target  # noqa: F401 - fixture, used by name


def test_two_ranks_write_the_data_of_one_process(target, tmp_path):
    # --max-batch-size 1 -> chunks of 8 prompts: 20 prompts are chunks of 8, 8 and 4; rank 0 writes chunks 0 and 2,
    # rank 1 chunk 1 (had either skipped its share, the merge would find a chunk missing)
    prompts = [" ".join(ws) for ws in itertools.islice(itertools.permutations(WORDS[2:8], 3), 20)]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = ["draft-data", "--target", str(target.source.path), "--prompts", str(tmp_path / "p.txt"), "--max-tokens",
            "6", "--max-batch-size", "1", "--device", "cpu"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    status, output = torchrun(args + ["--out", str(tmp_path / "two")])
    assert status == 0, output[-3000:]
    assert output.count("wrote 20 sequences") == 1  # rank 0 reports, once
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert (two.num_sequences, two.num_tokens, two.num_response_tokens) == \
        (one.num_sequences, one.num_tokens, one.num_response_tokens) == (20, one.num_tokens, 20 * 6)
    assert two.meta["finish_reasons"] == one.meta["finish_reasons"] == {"length": 20}
    assert two.meta["ranks"] == 2 and "ranks" not in one.meta
    a, b = read_shards(tmp_path / "one"), read_shards(tmp_path / "two")
    assert [s.input_ids.tolist() for s in a] == [s.input_ids.tolist() for s in b]
    assert [s.loss_mask.tolist() for s in a] == [s.loss_mask.tolist() for s in b]
    assert not (tmp_path / "two" / "parts").exists()

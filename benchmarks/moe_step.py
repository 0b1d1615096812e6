"""Step benchmark for a mixture-of-experts target on the GPU (issue 41): the engine's captured decode step, plain and
DFlash, on a Qwen3-30B-A3B-shaped bf16 target with random weights (made on the device) and a 5-layer block-16
drafter, against a floor that counts the experts a step actually reads.

Floor: benchmarks/parts.py's FLOOR_DEFINITION, with the target's matrices counted as its dense weights (attention,
norms, routers) plus, per MoE layer, the experts its rows chose in that step, each once (the union over the step's
rows: what the fused kernel reads, layers/fused_moe.py). The unions are recorded from one eager pass of the same
step on the same inputs. With random weights the router is near uniform, so a verify block's union is close to the
random-routing expectation (E (1 - (1 - k/E)^rows)); a trained model's rows agree more and read fewer experts.
Layers: the full 48 need ~61 GB of bf16 weights and do not fit an 80 GB H100 beside the step's buffers; `--layers auto`
(the default) keeps every layer where the GPU has over 100 GiB and 24 of the same shape elsewhere. The floor counts
the model as built, so it scales with the layers, and the step/floor ratio is per layer the same quantity.
Usage: python -m benchmarks.moe_step --out docs/results/data/moe-step-DEVICE-DATE.json [--batches 1,8] [--K 15]
[--layers auto|N]"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.parts import floor_bytes, floor_ms
from benchmarks.random_pair import make_pair
from benchmarks.step import copy_bandwidth, decode_step, free_memory, time_ms
from blockspec.layers.moe import SparseMoeBlock
from blockspec.models.dflash_config import default_target_layer_ids

QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False)
MASK, DRAFT_LAYERS = 151669, 5


def layers_for(arg: str) -> int:
    if arg != "auto":
        return int(arg)
    return 48 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 24


def expert_bytes(block: SparseMoeBlock) -> int:
    gate_up, down = block.stacked
    return (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()


def step(lm, draft, B: int, ctx: int, K: int) -> dict:
    """Graph ms of one decode step of B requests at context ctx (K drafts, 0: plain) and the experts each MoE layer
    read in it (one eager pass of the same step)."""
    engine, bench = decode_step(lm, draft, B, ctx, K)
    unions: list[int] = []
    blocks = [m for m in lm.model.modules() if isinstance(m, SparseMoeBlock)]
    route = SparseMoeBlock.route

    def recorded(self, x):
        weights, ids = route(self, x)
        unions.append(int(ids.unique().numel()))
        return weights, ids

    with torch.inference_mode():
        SparseMoeBlock.route = recorded
        try:
            bench.eager()
        finally:
            SparseMoeBlock.route = route
        bench.graph()  # warm-up + capture
        ms = time_ms(bench.graph, 30)
    return {"ms": ms, "experts_read": unions[:len(blocks)], "rows": B * (K + 1)}


def moe_floor(lm, draft, B: int, ctx: int, unions: list[int]) -> dict:
    """floor_bytes with the experts counted as read: the dense weights, plus each layer's union once."""
    parts = floor_bytes(lm, draft, B, ctx)
    blocks = [m for m in lm.model.modules() if isinstance(m, SparseMoeBlock)]
    all_experts = sum(len(b.experts) * expert_bytes(b) for b in blocks)
    read = sum(n * expert_bytes(b) for b, n in zip(blocks, unions))
    parts["target_matrices"] += read - all_experts
    parts["experts_read"] = read
    parts["total"] += read - all_experts
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_step_bench.json")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--K", type=int, default=15)
    ap.add_argument("--layers", default="auto", help="target layers of the 30B-A3B shape (auto: 48 where it fits, else 24)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    num_layers = layers_for(args.layers)
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": num_layers}
    taps = default_target_layer_ids(num_layers, DRAFT_LAYERS)
    lm, draft = make_pair(shape, args.K, DRAFT_LAYERS, taps, MASK, torch.device("cuda"), torch.bfloat16)
    for m in lm.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.stack_experts()  # what load_model's prepare_target does on CUDA
    free_memory()
    rows = []
    for B in map(int, args.batches.split(",")):
        ar = step(lm, None, B, args.context, 0)
        free_memory()
        spec = step(lm, draft, B, args.context, args.K)
        free_memory()
        ar_floor, spec_floor = moe_floor(lm, None, B, args.context, ar["experts_read"]), \
            moe_floor(lm, draft, B, args.context, spec["experts_read"])
        r = {"batch": B, "context": args.context, "K": args.K, "ar_step_ms": ar["ms"], "spec_step_ms": spec["ms"],
             "ar_floor_ms": floor_ms(ar_floor, bw), "spec_floor_ms": floor_ms(spec_floor, bw),
             "ar_experts_read_per_layer": sum(ar["experts_read"]) / len(ar["experts_read"]),
             "spec_experts_read_per_layer": sum(spec["experts_read"]) / len(spec["experts_read"]),
             "ar_bytes": ar_floor["total"], "spec_bytes": spec_floor["total"],
             "spec_over_ar_bytes": spec_floor["total"] / ar_floor["total"], "spec_over_ar_ms": spec["ms"] / ar["ms"]}
        r["ar_ratio_to_floor"] = r["ar_step_ms"] / r["ar_floor_ms"]
        r["spec_ratio_to_floor"] = r["spec_step_ms"] / r["spec_floor_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9,
              "target": f"Qwen3-30B-A3B-shaped, random bf16 weights (128 experts, top-8, {num_layers} of its 48 layers)",
              "num_layers": num_layers,
              "drafter": f"{DRAFT_LAYERS}-layer block-16 DFlash, random", "floor": __doc__.split("\n\n")[1],
              "target_weight_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters()),
              "table": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

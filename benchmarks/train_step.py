"""Training-step benchmark on the GPU, in one run: one micro-batch of the drafter trainer (frozen target pass, draft
layers over anchors x B block rows, chunked loss, backward) on a SmolLM2-135M-shaped bf16 target with random weights
and synthetic sequences, with the draft pass eager and compiled (`train-draft --compile-draft`), plus an optional
torch-profiler table of the eager step. Same weights and micro-batches for both, so their losses and gradient norms
must agree. Usage: python -m benchmarks.train_step [--layers 4] [--anchors 4096] [--profile] [--json]"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockspec.data.shards import TokenSequence
from blockspec.loading.loader import LoadedModel, instantiate
from blockspec.models.config import ModelConfig
from blockspec.train.anchors import slot_weights
from blockspec.train.batches import MicroBatch, build_micro_batch, generator
from blockspec.train.compiled_draft import CompiledDraftPass
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import capacity, plan_epochs, prepare
from blockspec.train.forward import TrainingForward
from blockspec.train.setup import DraftShape, new_draft

SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def synthetic_sequences(n: int, seed: int = 0) -> list[TokenSequence]:
    """Prompt 50-300 + response 100-600 random tokens (the bundled drafter's data has 256-token responses or less)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        p, r = int(torch.randint(50, 300, (1,), generator=g)), int(torch.randint(100, 600, (1,), generator=g))
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        seqs.append(TokenSequence(torch.randint(0, 49000, (p + r,), generator=g), mask))
    return seqs


def time_steps(fwd: TrainingForward, mbs: list[MicroBatch], warmup: int) -> tuple[float, float, float]:
    """(ms per micro-batch after `warmup` of them, seconds of warm-up, loss of the last)."""
    t0 = time.perf_counter()
    for mb in mbs[:warmup]:
        fwd(mb).loss_sum.backward()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for mb in mbs[warmup:]:
        r = fwd(mb)
        r.loss_sum.backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / (len(mbs) - warmup), warm, float(r.loss_sum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=4096, help="anchor blocks per micro-batch (--batch-anchors)")
    ap.add_argument("--micro-batches", type=int, default=10, help="timed after 2 warm-up ones")
    ap.add_argument("--profile", action="store_true", help="print a torch-profiler table of 4 eager micro-batches")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    cfg_m = ModelConfig.from_hf(SMOLLM2_135M, "smollm2-135m-shaped")
    model = instantiate(cfg_m, cuda, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    lm = LoadedModel(model.eval(), cfg_m, None, [], None)
    cfg = TrainConfig(batch_anchors=args.anchors)
    setup = new_draft(lm, DraftShape(num_layers=args.layers, block_size=16), 0, cuda)
    data = prepare(synthetic_sequences(400), cfg, "synthetic")
    cap = capacity(data, cfg, 16, pad=True)
    plan = plan_epochs(data, cap, cfg)[0]
    mbs = [build_micro_batch([data.seqs[i] for i in plan[j]], cap, cfg.num_anchors, setup.mask_token_id,
                             slot_weights(16, 7.0), generator(0, j)).to(cuda) for j in range(2 + args.micro_batches)]
    fwd = TrainingForward(lm.model, setup.model, setup.tap_layers, cap, "flex", compiled=True)
    draft = setup.model
    report: dict = {"layers": args.layers, "anchors": args.anchors, "block_rows": cap.rows, "tokens": cap.tokens}
    for name, draft_pass in (("eager", draft), ("compiled", CompiledDraftPass(draft))):
        fwd.draft_pass = draft_pass
        draft.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        ms, warm, loss = time_steps(fwd, mbs, 2)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(draft.parameters(), float("inf")))
        tok_s = sum(mb.num_tokens for mb in mbs[2:]) / (ms * 1e-3 * (len(mbs) - 2))
        report[name] = {"ms_per_micro_batch": round(ms, 2), "warmup_s": round(warm, 1), "target_tokens_per_s":
                        round(tok_s), "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                        "last_loss": round(loss, 3), "grad_norm": round(grad_norm, 4)}
        print(f"{name}: {ms:.1f} ms per micro-batch ({cap.rows} block rows, {cap.tokens} target tokens), "
              f"{tok_s:,.0f} target tok/s, warm-up {warm:.1f} s, last loss {loss:.2f}, grad norm {grad_norm:.3f}",
              flush=True)
    report["speedup"] = round(report["eager"]["ms_per_micro_batch"] / report["compiled"]["ms_per_micro_batch"], 3)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        fwd.draft_pass = draft
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            time_steps(fwd, mbs[:6], 2)
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()

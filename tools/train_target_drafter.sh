#!/usr/bin/env bash
# The DFlash drafters of the registry's Qwen2.5-Coder targets (issue 25): tools/train_bundled_drafter.sh's recipe with
# each target's file and sha256 (tools/registry_models.py) and drafter shape; every knob of that script still applies.
#   TARGET=qwen2.5-coder-1.5b|qwen2.5-coder-0.5b PROMPTS=mix-coder.jsonl [GGUF=.cache/models/<its file>] \
#     [STAGE=data|train] [BACK=$OUT] tools/train_target_drafter.sh      (the plan: docs/training.md, issue 25 section)
# Results go to WORK/out (default WORK: /tmp/TARGET-drafter); OUT is not read here, because on the device machine
# $OUT is the folder that comes back: pass it as BACK (model.safetensors whole is over the 16 MiB a file may be).
#
# Size of model.safetensors in bf16 (the drafter uses the target's embeddings and lm_head, which are not saved):
#   2 x (T H^2 + 2 H + L (2 H q + 2 H kv + 3 H I + 2 H + 2 d)) bytes (+ a ~3 kB header)
# H hidden size, d head_dim, q = heads x d, kv = KV heads x d (the target's); T taps, L layers, I = INTERMEDIATE.
#   1.5B (H 1536, q 1536, kv 256, d 128): a tap 4.7 MB (fc), a layer's attention 11.0 MB, its MLP 9.2 kB per unit of I.
#     L 2, T 3 (layers 1,13,25), I 640: 47,994,392 B (45.8 MiB). The paper's shape (L 5, T 5, I 8960): 492 MB.
#   0.5B (H 896, q 896, kv 128, d 64): a tap 1.6 MB, a layer's attention 3.7 MB, its MLP 5.4 kB per unit of I.
#     L 3, T 5 (layers 1,6,11,16,21), I 1792: 47,958,376 B (45.7 MiB). The paper's shape (L 5, T 5, I 4864): 157 MB.
# Each is the widest MLP (a multiple of 128) that keeps its drafter under issue 25's ~50 MB for the repository, and
# comes back from the device in 4 parts of <= 15 MiB plus manifest.json and run.tgz: 6 of the 8 files one call returns.
# Per target also (docs/training.md): TRAIN_TOKENS, what TIME_LIMIT's 7 minutes train at the measured rate (1.5B:
# 27.6 k target tokens/s on the H200, 2026-12-05; 0.5B scaled by the estimates' ratio, not yet measured); LIMIT, the
# prompts whose answers make about that many tokens (~350 a sequence), so a fast generation stops there and a slow
# one at GEN_SECONDS (1.5B measured: 12,000 prompts in 93 s); BATCH 256 for the 1.5B.
set -euo pipefail
TARGET=${TARGET:?qwen2.5-coder-0.5b or qwen2.5-coder-1.5b}
case "$TARGET" in   # layers, MLP width, taps, batch, training tokens, prompts
  qwen2.5-coder-1.5b) shape=(2 640 1,13,25 256 11000000 32000) ;;
  qwen2.5-coder-0.5b) shape=(3 1792 1,6,11,16,21 512 17000000 48000) ;;
  *) echo "TARGET=$TARGET: expected qwen2.5-coder-0.5b or qwen2.5-coder-1.5b"; exit 2 ;;
esac
line=$(python3 "$(dirname "$0")/registry_models.py" sha "$TARGET")
read -r sha file <<< "$line"
export SHA256=$sha GGUF=${GGUF:-.cache/models/$file} WORK=${WORK:-/tmp/$TARGET-drafter}
export OUT=$WORK/out
export LAYERS=${LAYERS:-${shape[0]}} INTERMEDIATE=${INTERMEDIATE:-${shape[1]}} TAPS=${TAPS:-${shape[2]}}
export BATCH=${BATCH:-${shape[3]}} TRAIN_TOKENS=${TRAIN_TOKENS:-${shape[4]}} LIMIT=${LIMIT:-${shape[5]}}
# sized for one device call each (10 minutes): generation incl. loading, then training after ~1 minute of loading
export GEN_SECONDS=${GEN_SECONDS:-480} TIME_LIMIT=${TIME_LIMIT:-7} COMPILE=${COMPILE:-1} EVAL_SETS=${EVAL_SETS-}
exec "$(dirname "$0")/train_bundled_drafter.sh"

#!/usr/bin/env bash
# How the bundled SmolLM2-135M-Instruct DFlash drafter is made, on one H200, from the repository root.
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf PROMPTS="chat_code.jsonl math.jsonl" OUT=results/ \
#     tools/train_bundled_drafter.sh
# PROMPTS: one or more JSONL files from tools/prepare_{prompts,math_prompts,code_stubs,prose_prompts,qa_prompts}.py
# or tools/sample_user_prompts.py (requests the target writes itself; runs K-M); each
# becomes its own data directory (WORK/data-<name>) and training uses them all. Every stage resumes: run the script
# again after a time limit and it continues (data chunks already generated are kept; training resumes from
# WORK/run/checkpoint.pt). The drafter was trained in stages, each continuing the previous one (docs/training.md):
#   INIT=<previous drafter> [LAYERS=N to grow it] EPOCHS=E LR=... [WARMUP=0.02] [COMPILE=1: --compile-draft, ~1.4x]
#   [TIME_LIMIT=MIN: --time-limit, stop cleanly before a job's wall-clock limit; run the script again to resume]
#   [DISTILL=W: --distill-weight W, labels mixed with the target's own distribution (experimental)]
#   [WALK=W: --walk-weight W, the blocks verification visits weigh 1 + W (runs L, M: W = 2, then 4)]
#   [OPENING=W: --opening-weight W, the blocks in a response's first 64 tokens weigh 1 + W (experimental)]
#   [PREFIX=P: --prefix-weight P, a slot past the block's first miss weighs 1 - P (runs O, P: P = 0.5, then 1.0)]
#   (without INIT: a new LAYERS-layer drafter)
set -euo pipefail
GGUF=${GGUF:?path of the SmolLM2-135M-Instruct Q4_1 GGUF}
PROMPTS=${PROMPTS:?JSONL files of training prompts}
WORK=${WORK:-/tmp/bundled-drafter}
OUT=${OUT:-$WORK/out}
BLOCKSPEC=${BLOCKSPEC:-python3 -m blockspec.cli}
mkdir -p "$WORK" "$OUT"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c -

# DRAFT=an earlier drafter of this target: the responses are generated with speculative decoding (same tokens,
# less time). LIMIT=N uses the first N prompts of each file only.
data=()
for prompts in $PROMPTS; do
  dir="$WORK/data-$(basename "$prompts" .jsonl)"
  if [ ! -f "$dir/manifest.json" ]; then
    $BLOCKSPEC draft-data --target "$GGUF" --prompts "$prompts" --out "$dir" ${LIMIT:+--limit "$LIMIT"} \
      --max-tokens "${GEN_TOKENS:-256}" --max-batch-size 512 ${DRAFT:+--draft "$DRAFT" --num-draft-tokens 7}
  fi
  cp "$dir/manifest.json" "$OUT/manifest-$(basename "$dir").json"
  data+=("$dir")
done

shape=(--draft-layers "${LAYERS:-3}" --block-size 16)
[ -n "${INIT:-}" ] && shape=(--init "$INIT" ${LAYERS:+--draft-layers "$LAYERS"})
resume=""
[ -f "$WORK/run/checkpoint.pt" ] && resume="--resume"
$BLOCKSPEC train-draft --target "$GGUF" --data "${data[@]}" --out "$WORK/run" "${shape[@]}" --epochs "${EPOCHS:-6}" \
  --lr "${LR:-6e-4}" --warmup-ratio "${WARMUP:-0.04}" --seed "${SEED:-0}" ${COMPILE:+--compile-draft} \
  ${TIME_LIMIT:+--time-limit "$TIME_LIMIT"} ${DISTILL:+--distill-weight "$DISTILL"} ${WALK:+--walk-weight "$WALK"} \
  ${OPENING:+--opening-weight "$OPENING"} ${PREFIX:+--prefix-weight "$PREFIX"} \
  --save-every 200 --eval-set humaneval --eval-num-prompts 16 \
  --eval-every 1000 --val-fraction 0.02 $resume
cp "$WORK/run/config.json" "$WORK/run/model.safetensors" "$WORK/run/train_report.json" "$WORK/run/train_log.jsonl" "$OUT/"
if grep -q '"stopped_by_time_limit": true' "$WORK/run/train_report.json"; then
  echo "stopped by TIME_LIMIT: run this script again to resume (the drafter so far is in $OUT)"; exit 0
fi

for set in humaneval mtbench; do
  $BLOCKSPEC eval-draft --model "$GGUF" --draft "$WORK/run" --dataset "$set" --max-tokens 256 --max-batch-size 16 \
    --out-dir "$OUT/eval-$set" --json | tail -1 > "$OUT/eval-$set.json"
done

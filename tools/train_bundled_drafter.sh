#!/usr/bin/env bash
# How the bundled SmolLM2-135M-Instruct DFlash drafter is made, on one H200, from the repository root (and, through
# tools/train_target_drafter.sh, the drafters of the registry's Qwen2.5-Coder targets: same recipe, other defaults).
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
#   [ARCH=dflash2: --arch dflash2, a DFlash 2 drafter; with INIT it upgrades a DFlash 1 drafter (docs/dflash2.md)]
#   (without INIT: a new LAYERS-layer drafter, [INTERMEDIATE=N: --intermediate-size] [TAPS=1,8,...: its taps])
# Other targets and device calls of at most 10 minutes:
#   SHA256=<the GGUF's sha256> (default: the SmolLM2 file's); BATCH=N: --max-batch-size of data generation (512)
#   STAGE=data|train: only generate the data, or only train on what is there (default: both)
#   GEN_SECONDS=S: stop data generation after S seconds; training then uses the chunks finished by then
#   TRAIN_TOKENS=N: EPOCHS = N / the data's tokens, 1 to 6 (instead of EPOCHS)
#   EVAL_SETS="humaneval mtbench": eval-draft sets after training ("" for none)
#   BACK=DIR: DIR/model-parts (model.safetensors in parts of <= 15 MiB, `tools/carry.py back`) and DIR/run.tgz (the
#   rest of OUT): what a device call brings back from its $OUT (8 files, 16 MiB each); `tools/carry.py join` here
set -euo pipefail
GGUF=${GGUF:?path of the SmolLM2-135M-Instruct Q4_1 GGUF}
PROMPTS=${PROMPTS:?JSONL files of training prompts}
WORK=${WORK:-/tmp/bundled-drafter}
OUT=${OUT:-$WORK/out}
BLOCKSPEC=${BLOCKSPEC:-python3 -m blockspec.cli}
STAGE=${STAGE:-all}
mkdir -p "$WORK" "$OUT"
echo "${SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}  $GGUF" | sha256sum -c -

# DRAFT=an earlier drafter of this target: the responses are generated with speculative decoding (same tokens,
# less time). LIMIT=N uses the first N prompts of each file only.
data=()
for prompts in $PROMPTS; do
  name=$(basename "$prompts" .jsonl)
  dir="$WORK/data-$name"
  if [ ! -f "$dir/manifest.json" ] && [ "$STAGE" != train ]; then
    ${GEN_SECONDS:+timeout -k 20 "$GEN_SECONDS"} $BLOCKSPEC draft-data --target "$GGUF" --prompts "$prompts" \
      --out "$dir" ${LIMIT:+--limit "$LIMIT"} --max-tokens "${GEN_TOKENS:-256}" --max-batch-size "${BATCH:-512}" \
      ${DRAFT:+--draft "$DRAFT" --num-draft-tokens 7} ||
      { rc=$?; [ -n "${GEN_SECONDS:-}" ] && [ $rc -ge 124 ] || exit $rc; }
  fi
  if [ -f "$dir/manifest.json" ]; then
    cp "$dir/manifest.json" "$OUT/manifest-data-$name.json"
    data+=("$dir")
    continue
  fi
  # stopped by GEN_SECONDS (timeout's 124, or 137 after its kill): each finished chunk is a data directory of its
  # own (blockspec/train/data_builder.py), and the same command generates the rest later
  for part in "$dir"/parts/part-*; do
    [ -f "$part/manifest.json" ] || continue
    cp "$part/manifest.json" "$OUT/manifest-data-$name-$(basename "$part").json"
    data+=("$part")
  done
done
[ "${#data[@]}" -gt 0 ] || { echo "no finished data in $WORK/data-*: generate longer (GEN_SECONDS) first"; exit 1; }
[ "$STAGE" = data ] && { echo "data: ${data[*]}"; exit 0; }

if [ -n "${TRAIN_TOKENS:-}" ]; then
  tokens=$(python3 -c 'import json, sys
print(sum(json.load(open(f"{d}/manifest.json"))["num_tokens"] for d in sys.argv[1:]))' "${data[@]}")
  e=$(( TRAIN_TOKENS / tokens ))
  EPOCHS=$(( e < 1 ? 1 : e > 6 ? 6 : e ))
  echo "data: $tokens tokens; TRAIN_TOKENS=$TRAIN_TOKENS -> $EPOCHS epoch(s)"
fi
shape=(--draft-layers "${LAYERS:-3}" --draft-block-size 16 ${INTERMEDIATE:+--intermediate-size "$INTERMEDIATE"}
       ${TAPS:+--target-layer-ids "$TAPS"})
[ -n "${INIT:-}" ] && shape=(--init "$INIT" ${LAYERS:+--draft-layers "$LAYERS"})
shape+=(${ARCH:+--arch "$ARCH"})
resume=""
[ -f "$WORK/run/checkpoint.pt" ] && resume="--resume"
$BLOCKSPEC train-draft --target "$GGUF" --data "${data[@]}" --out "$WORK/run" "${shape[@]}" --epochs "${EPOCHS:-6}" \
  --lr "${LR:-6e-4}" --warmup-ratio "${WARMUP:-0.04}" --seed "${SEED:-0}" ${COMPILE:+--compile-draft} \
  ${TIME_LIMIT:+--time-limit "$TIME_LIMIT"} ${DISTILL:+--distill-weight "$DISTILL"} ${WALK:+--walk-weight "$WALK"} \
  ${OPENING:+--opening-weight "$OPENING"} ${PREFIX:+--prefix-weight "$PREFIX"} \
  --save-every 200 --eval-set humaneval --eval-num-prompts 16 \
  --eval-every 1000 --val-fraction 0.02 $resume
cp "$WORK/run/config.json" "$WORK/run/model.safetensors" "$WORK/run/train_report.json" "$WORK/run/train_log.jsonl" "$OUT/"
stopped=""
grep -q '"stopped_by_time_limit": true' "$WORK/run/train_report.json" && stopped=1

if [ -z "$stopped" ]; then
  for set in ${EVAL_SETS-humaneval mtbench}; do
    $BLOCKSPEC eval-draft --model "$GGUF" --draft "$WORK/run" --dataset "$set" --max-tokens 256 --max-batch-size 16 \
      --out-dir "$OUT/eval-$set" --json | tail -1 > "$OUT/eval-$set.json"
  done
fi
if [ -n "${BACK:-}" ]; then
  rm -rf "$BACK/model-parts" && mkdir -p "$BACK"
  python3 tools/carry.py back "$OUT/model.safetensors" --parts-dir "$BACK/model-parts"
  tar -czf "$BACK/run.tgz" -C "$OUT" --exclude=./model.safetensors .
fi
if [ -n "$stopped" ]; then
  echo "stopped by TIME_LIMIT: run this script again to resume (the drafter so far is in $OUT)"
fi

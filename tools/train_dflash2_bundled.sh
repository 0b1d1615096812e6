#!/usr/bin/env bash
# The DFlash 2 drafter at the bundled drafter's scale (issue 40): run P, the shipped DFlash 1 drafter, upgraded with
# `--arch dflash2` (identity convolutions, an argmax selector: it starts drafting exactly as run P) and trained on fresh
# requests the target writes itself (runs O/P's recipe, new seeds), then evaluated beside run P on the same machine.
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf [STAGE=data|train] [BACK=$OUT] tools/train_dflash2_bundled.sh
# Sized for two device calls of at most 10 minutes on one H100/H200 (STAGE=data, then STAGE=train; WORK must survive
# between them, i.e. back to back on a warm machine). Knobs: N requests sampled (16,000: half general, a quarter
# "Write a Python function that", an eighth each "Explain" and "Solve"), TRAIN_TOKENS (9 M, run P's epoch), LR
# (1.5e-4), TIME_LIMIT (minutes of training, 5), GEN_TOKENS (256), GEN_SECONDS (draft-data's limit per prompt file),
# EVAL_LIMIT (all prompts), COMPILE (1). The H100 run of docs/dflash2.md: STAGE=data N=8000 GEN_SECONDS=60, then
# STAGE=train TRAIN_TOKENS=5700000 TIME_LIMIT=4.5 (149 s and 563 s).
# The tau table goes to WORK/out/eval-<drafter>-<set>-<mode>.json (fp32 and bf16 --batch-invariant: the modes whose
# outputs equal plain decoding); BACK=DIR gets run.tgz: WORK/out without the weights (83.6 MB in bf16, 50 MB of them
# the selector's two 49,152 x 256 codebooks: more than one device call brings back) and their sha256.
set -euo pipefail
GGUF=${GGUF:?path of the SmolLM2-135M-Instruct Q4_1 GGUF}
WORK=${WORK:-/tmp/dflash2-bundled}
PY=${PY:-python3}
RUN_P=blockspec/drafters/smollm2-135m-dflash-b16
STAGE=${STAGE:-all}
N=${N:-16000}
mkdir -p "$WORK/prompts" "$WORK/out"

sample() {  # name, requests, seed, [user start]
  [ -f "$WORK/prompts/$1.jsonl" ] && return 0
  $PY tools/sample_user_prompts.py "$WORK/prompts/$1.tmp" --target "$GGUF" --num "$2" --max-tokens 200 --seed "$3" \
    ${4:+--user-start "$4"} && mv "$WORK/prompts/$1.tmp" "$WORK/prompts/$1.jsonl"
}
if [ "$STAGE" != train ]; then
  t0=$SECONDS
  sample general $((N / 2)) 20000000 & sample code $((N / 4)) 21000000 "Write a Python function that" &
  sample explain $((N / 8)) 22000000 "Explain" & sample solve $((N / 8)) 23000000 "Solve" &
  wait
  echo "prompts: $(cat "$WORK"/prompts/*.jsonl | wc -l) requests in $((SECONDS - t0)) s"
fi

export GGUF WORK OUT="$WORK/out" PROMPTS="$(ls "$WORK"/prompts/*.jsonl | tr '\n' ' ')" DRAFT=$RUN_P INIT=$RUN_P
export ARCH=dflash2 LR=${LR:-1.5e-4} WARMUP=0.02 SEED=${SEED:-17} WALK=4 PREFIX=1.0 EVAL_SETS=""
export TRAIN_TOKENS=${TRAIN_TOKENS:-9000000} TIME_LIMIT=${TIME_LIMIT:-5} COMPILE=${COMPILE-1}
if [ "$STAGE" != train ]; then STAGE=data tools/train_bundled_drafter.sh; fi
[ "$STAGE" = data ] && exit 0
t0=$SECONDS
BACK= STAGE=train tools/train_bundled_drafter.sh  # BACK here is this script's (no weight parts)
echo "training: $((SECONDS - t0)) s"

evaluate() {  # drafter name, drafter dir, dataset, mode, flags
  $PY -m blockspec.cli eval-draft --model "$GGUF" --draft "$2" --dataset "$3" --max-tokens 256 --max-batch-size 16 \
    ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} "${@:5}" --json | tail -1 > "$WORK/out/eval-$1-$3-$4.json"
}
t0=$SECONDS
for set in humaneval mtbench; do
  evaluate run-P $RUN_P $set fp32 --dtype float32 & evaluate dflash2 "$WORK/run" $set fp32 --dtype float32 &
  evaluate run-P $RUN_P $set bf16-inv --batch-invariant & evaluate dflash2 "$WORK/run" $set bf16-inv --batch-invariant &
  wait
done
echo "evaluation: $((SECONDS - t0)) s"
$PY - "$WORK"/out/eval-*.json <<'EOF'
import json, sys
for f in sys.argv[1:]:
    try:
        r = json.load(open(f))
    except ValueError:
        print(f"{f}: no report (the evaluation failed: its error is above)")
        continue
    print(f"{f.rsplit('/', 1)[-1]}: tau {r['mean_acceptance_length']:.3f} identical {r['outputs_identical']} "
          f"speedup {r['speedup']:.2f}")
EOF
if [ -n "${BACK:-}" ]; then
  mkdir -p "$BACK"
  (cd "$WORK/out" && sha256sum model.safetensors > model.sha256)
  tar -czf "$BACK/run.tgz" -C "$WORK/out" --exclude=./model.safetensors .
fi

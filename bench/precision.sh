#!/usr/bin/env bash
# docs/benchmarks.md, "Precision": for each model, its float32 tables and its int8 ones
# (`vbs plan --precision auto`, calibrated on the model's own example inputs, the guard at its
# default), the int8 model as one ONNX file for Triton, then bench/peers.py over HTTP: vbs
# float32, vbs int8, Triton + ONNX Runtime with the float32 export as users run it (threads
# spinning) and tuned, and Triton with the same int8 file, interleaved rounds.
#   bash bench/precision.sh [WORK_DIR] (default /tmp/vbs-precision); MODELS (space-separated),
#   BATCH (the largest batch of every server), CLIENTS, ROUNDS, DURATION and MAX_ERROR (the
#   guard's bound, default 0.01) override; PRECISION=int8 plans the int8 model in int8 even
#   where auto measures int8 slower here and stays float32 (then its export is float32 too);
#   BF16=1 also plans and serves the model in bfloat16 on torch (MODEL-bf16, vbs-bf16), F16=1
#   in float16 (MODEL-f16, vbs-f16)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/vbs-precision}
py=${PY:-.venv-peers/bin/python}
vbs=$(dirname "$py")/vbs
batch=${BATCH:-8}
export VBS_CACHE_DIR=${VBS_CACHE_DIR:-$HOME/.cache/vbs-serve}
store=${STORE:-$VBS_CACHE_DIR/peers-store}
read -r -a models <<< "${MODELS:-resnet50 mobilenet_v2}"
mkdir -p "$work"
for model in "${models[@]}"; do
  "$py" bench/calibration_samples.py --model "$model" --count 64 --out "$work/$model-calibration"
  "$vbs" plan --model "$model" --store "$store" --batch-max "$batch" --replan --quiet
  "$vbs" plan --model "$model-int8=$model" --precision "${PRECISION:-auto}" --calibration "$work/$model-calibration" \
    --max-error "${MAX_ERROR:-0.01}" --store "$store" --batch-max "$batch" --replan --quiet
  "$py" bench/int8_export.py --store "$store" --served "$model-int8" --model "$model" \
    --out "$work/$model-int8.onnx"
  halves=()
  only=vbs,vbs-int8
  for half in ${BF16:+bf16} ${F16:+f16}; do
    dtype=$([[ $half == bf16 ]] && echo bfloat16 || echo float16)
    "$vbs" plan --model "$model-$half=$model" --precision "$dtype" --calibration "$work/$model-calibration" \
      --max-error "${MAX_ERROR:-0.01}" --store "$store" --batch-max "$batch" --replan --quiet
    halves+=(--"$half" "$work/$model-calibration")
    only+=,vbs-$half
  done
  "$py" bench/peers.py --model "$model" --store "$store" --batch-max "$batch" \
    --clients "${CLIENTS:-8}" --duration "${DURATION:-20}" --warmup 5 --rounds "${ROUNDS:-2}" \
    --batch-sizes "$batch" --int8 "$work/$model-int8.onnx" "${halves[@]}" \
    --only "$only,triton-ort-spin-$batch,triton-ort-$batch,triton-ort-int8-$batch" \
    --json "$work/$model-peers.json"
done

#!/usr/bin/env bash
# docs/benchmarks.md, "What plans gain over a uniform batch": `vbs bench` on this machine for
# the image models of the paper's Table II, mnasnet0_5 and regnet_x_400mf, every strategy
# side by side at every budget, on the default runtime (auto: every unit profiled on torch and
# on ONNX Runtime, every plan priced with its calls), then the Markdown tables of the results.
#   bash bench/plans_measured.sh [OUT_DIR] (default docs/bench); BATCH, MEMORY, REPEAT and
#   MODELS (space-separated) override
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
vbs=${VBS:-.venv/bin/vbs}
batch=${BATCH:-16}
memory=${MEMORY:-auto}
repeat=${REPEAT:-5}
read -r -a models <<< "${MODELS:-mnasnet0_5 regnet_x_400mf mobilenet_v2 squeezenet1_0 googlenet resnet50}"
for model in "${models[@]}"; do
  "$vbs" bench --model "$model" --batch "$batch" --memory "$memory" --repeat "$repeat" --out "$out"
done
.venv/bin/python -m workers.plans_measured $(printf "$out/%s.json " "${models[@]}")

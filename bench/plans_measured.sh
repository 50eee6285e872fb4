#!/usr/bin/env bash
# docs/benchmarks.md, "What plans gain over a uniform batch": `vbs bench` on this machine for
# the image models of the paper's Table II, every strategy side by side at every budget, on the
# default runtime (auto: every unit on the faster of torch and ONNX Runtime as profiled), then
# the Markdown tables of the results.
#   bash bench/plans_measured.sh [OUT_DIR] (default docs/bench); BATCH, MEMORY, REPEAT override
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
vbs=${VBS:-.venv/bin/vbs}
batch=${BATCH:-8}
memory=${MEMORY:-auto:5}
repeat=${REPEAT:-3}
models=(mobilenet_v2 squeezenet1_0 googlenet resnet50)
for model in "${models[@]}"; do
  "$vbs" bench --model "$model" --batch "$batch" --memory "$memory" --repeat "$repeat" --out "$out"
done
.venv/bin/python -m workers.bench $(printf "$out/%s.json " "${models[@]}")

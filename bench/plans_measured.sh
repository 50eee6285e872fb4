#!/usr/bin/env bash
# docs/benchmarks.md, "Plans measured on the real model": `vbs bench` for the five models of the
# paper's Table II on this machine, every strategy side by side at every budget, then the
# Markdown tables of the results. Usage: bash bench/plans_measured.sh [OUT_DIR] (default docs/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
vbs=${VBS:-.venv/bin/vbs}
for model in googlenet resnet50 squeezenet1_0 mobilenet_v2; do
  "$vbs" bench --model "$model" --batch 12 --memory auto:6 --repeat 5 --out "$out"
done
"$vbs" bench --model c3d --batch 12 --memory auto:4 --repeat 3 --out "$out"
.venv/bin/python -m workers.bench "$out"/{googlenet,resnet50,squeezenet1_0,mobilenet_v2,c3d}.json

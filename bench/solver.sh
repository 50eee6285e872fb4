#!/usr/bin/env bash
# docs/benchmarks.md, "The solver": the DP's and the plan-table build's times, regenerated.
#
#   bash bench/solver.sh [OUT_DIR]
#
# Profiles googlenet and resnet50 at b = 1..32 on a grid (`vbs profile --grid`, cached by
# fingerprint: a minute or two the first time), then times the DP and the full table build on
# the synthetic trees, the 150-unit chain and both measured profiles, 3 interleaved rounds
# (median and range), and the plain-Python recurrences against the numba kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/vbs-solver-bench}"
mkdir -p "$out"
PY="${PYTHON:-python}"
for model in googlenet resnet50; do
  "$PY" -m service.commands profile --model "$model" --batch-max 32 --grid --quiet \
    --out "$out/$model-32.json"
done
"$PY" -m planner.solver.build_times --repeat 3 --markdown \
  --profile "$out/googlenet-32.json" --profile "$out/resnet50-32.json"

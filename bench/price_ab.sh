#!/usr/bin/env bash
# docs/benchmarks.md section 3, "How a run is timed, before and after": `vbs bench` of the same
# models with the code at REV (a git worktree) and with this checkout, model by model, each side
# a process of its own in the order ORDER, then every run's errors of the served time
# (bench/price_ab.py); the worktree is removed at the end. Profiles go to OUT_DIR/cache: a
# second call with the same OUT_DIR (ORDER reversed, say) benches both sides again on the
# profiles the first measured.
#   bash bench/price_ab.sh REV OUT_DIR; MODELS, ORDER ("old new"), BATCH, MEMORY, REPEAT override
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?a git revision to compare against}
out=$(mkdir -p "${2:?an output directory}" && cd "$2" && pwd)
here=$(pwd)
read -r -a models <<< "${MODELS:-mnasnet0_5 regnet_x_400mf mobilenet_v2}"
read -r -a order <<< "${ORDER:-old new}"
old="$out/worktree"
[ -d "$old" ] || git worktree add --detach "$old" "$rev"
for model in "${models[@]}"; do
  for side in "${order[@]}"; do
    if [ "$side" = old ]; then dir=$(cd "$old" && pwd); else dir=$here; fi
    (cd "$dir" && PYTHONPATH="$dir" "$here/.venv/bin/vbs" bench --model "$model" \
      --batch "${BATCH:-16}" --memory "${MEMORY:-auto}" --repeat "${REPEAT:-3}" \
      --cache-dir "$out/cache" --out "$out/$side") > "$out/$side-$model.log" 2>&1
  done
done
git worktree remove --force "$old"
.venv/bin/python bench/price_ab.py "$out"/old/*.json "$out"/new/*.json

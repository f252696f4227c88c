#!/usr/bin/env bash
# Honest runs in a loop: N runs of each configuration, each with a fresh HOME (a fresh key) and a
# fresh random seed, trained with the record-time self-check on and then audited by replaying every
# step (`witness verify --challenges STEPS`). Counts self-check failures and verifier rejections;
# both must be 0. Not part of the suite (it runs for minutes to hours); run it in the background:
#
#   scripts/honest_loop.sh 200                       # every configuration, 200 runs each
#   CONFIGS="tinygpt:2" scripts/honest_loop.sh 200   # one configuration (TASK:THREADS[:STEPS[:RECIPE]])
#   CONFIGS="nanogpt-style:2:3:compile=true" scripts/honest_loop.sh 20   # recipe fields, comma-separated
#
# A failed run's output is kept under $KEEP (default honest-loop-failures/).
set -uo pipefail
n=${1:-20}
here=$(cd "$(dirname "$0")/.." && pwd)
witness=${WITNESS:-$here/.venv/bin/witness}
keep=${KEEP:-honest-loop-failures}
configs=${CONFIGS:-"tinygpt:2:3 tiny:1:20 tiny:2:20 tinycnn:1:20 tinycnn:2:20 nanogpt-style:1:6 nanogpt-style:2:6"}
mkdir -p "$keep"
# the nanogpt-style example trains on data/train.bin, made once from the standard library's sources
data="$here/examples/nanogpt_style/data"
[ -f "$data/train.bin" ] || "$here/.venv/bin/python" "$here/examples/nanogpt_style/prepare.py" --out "$data" >/dev/null
status=0
for cfg in $configs; do
  IFS=: read -r task threads steps recipe <<<"$cfg"
  steps=${steps:-3}
  fields=()
  for f in ${recipe//,/ }; do fields+=(--config "$f"); done
  selfcheck=0 rejected=0
  for i in $(seq 1 "$n"); do
    home=$(mktemp -d)
    run="$home/run"
    if ! HOME="$home" "$witness" train --task "$task" --steps "$steps" --checkpoint-every "$steps" \
        --threads "$threads" --out "$run" --quiet --data "$data" "${fields[@]}" >"$home/train.log" 2>&1; then
      selfcheck=$((selfcheck + 1))
      cp "$home/train.log" "$keep/$task-$threads${recipe:+-$recipe}-$i.train.log"
    elif ! HOME="$home" "$witness" verify "$run" --challenges "$steps" --threads "$threads" --data "$data" \
        >"$home/verify.log" 2>&1; then
      rejected=$((rejected + 1))
      cp "$home/verify.log" "$keep/$task-$threads${recipe:+-$recipe}-$i.verify.log"
    fi
    rm -rf "$home"
  done
  echo "$task${recipe:+ ($recipe)} at $threads thread(s), $steps steps: $n runs, $selfcheck stopped by the self-check, $rejected rejected"
  [ $((selfcheck + rejected)) -eq 0 ] || status=1
done
exit $status

#!/usr/bin/env bash
# nanoGPT's real train.py (examples/nanogpt), witnessed as it is written, in a loop: N runs, each in a
# fresh folder with a fresh key and a fresh run seed (so a fresh initial state and data order), with
# dropout and gradient accumulation, trained with the self-check on and then audited by replaying
# every step. Counts runs stopped by the self-check and runs the verifier rejected; both must be 0.
#
#   scripts/honest_loop_nanogpt.sh 50
set -uo pipefail
n=${1:-20}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
keep=${KEEP:-honest-loop-failures}
mkdir -p "$keep"
settings=(--device=cpu --compile=False --dtype=float32 --dataset=stdlib_char --n_layer=2 --n_head=2 --n_embd=64
          --block_size=64 --batch_size=4 --gradient_accumulation_steps=2 --max_iters=9 --dropout=0.2
          --eval_interval=5 --eval_iters=2 --log_interval=5 --warmup_iters=2 --lr_decay_iters=9)
stopped=0 rejected=0
for i in $(seq 1 "$n"); do
  work=$(mktemp -d)
  cp "$here"/examples/nanogpt/{train.py,model.py,configurator.py,prepare_stdlib.py} "$work"
  (cd "$work" && "$py" prepare_stdlib.py --bytes 60000 >/dev/null)
  if ! (cd "$work" && "$py" train.py "${settings[@]}" >train.log 2>&1); then
    stopped=$((stopped + 1)); cp "$work/train.log" "$keep/nanogpt-$i.train.log"
  elif ! (cd "$work" && "$py" -m witness.cli verify out/witness >verify.log 2>&1); then
    rejected=$((rejected + 1)); cp "$work/verify.log" "$keep/nanogpt-$i.verify.log"
  fi
  rm -rf "$work"
done
echo "nanoGPT train.py (dropout 0.2, accumulation 2, $(nproc) cores): $n runs, $stopped stopped by the self-check, $rejected rejected"
[ $((stopped + rejected)) -eq 0 ]

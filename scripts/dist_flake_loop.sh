#!/usr/bin/env bash
# The torchrun runs of tests/test_dist.py's module fixture, N times in a loop (default 50), with the
# rest of the test suite running alongside as load, as CI runs them. Every failure is kept with its
# output; the exit status is 0 only if all of them passed. Too slow for the suite itself (about
# 30-60 minutes on 2 cores).
#
#     scripts/dist_flake_loop.sh [N] [OUTDIR]
#
# It was written for the SIGABRT ("terminate called without an active exception") that a rank
# died with at exit: the process group outlived destroy_process_group, so its C++ threads were
# still running while the interpreter shut down (DistRecorder.close tears it down in order now).
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-50}"
OUT="${2:-$(mktemp -d -t witness-flake-XXXXXX)}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
"$PY" -c "from witness.commit.signing import generate_key, save_key; save_key(generate_key(), '$OUT/key.pem')"

# the load: the rest of the suite, over and over, in a session of its own (stopped as a whole)
setsid bash -c "while :; do '$PY' -m pytest -q -p no:cacheprovider --deselect tests/test_dist.py \
    -k 'not leaderboard and not browser' >>'$OUT/load.log' 2>&1; done" &
load=$!
trap 'kill -- -$load 2>/dev/null' EXIT

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
configs=("ddp" "fsdp" "ddp --grad-clip 0 --overlap" "fsdp --grad-clip 0 --overlap")
runs=0 failures=0
for i in $(seq 1 "$N"); do
  for cfg in "${configs[@]}"; do
    run="$OUT/run"
    rm -rf "$run"
    # shellcheck disable=SC2086 # the config is words
    if "$PY" -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 --master_port="$(free_port)" \
        tests/dist_worker.py --parallelism $cfg --out "$run" --key "$OUT/key.pem" >"$OUT/last.log" 2>&1; then
      :
    elif grep -qi "address already in use" "$OUT/last.log"; then
      continue  # the port was taken between choosing and binding it (the fixture retries this too)
    else
      failures=$((failures + 1))
      cp "$OUT/last.log" "$OUT/failure-$i-${cfg// /_}.log"
      echo "iteration $i, $cfg: FAILED (output in $OUT/failure-$i-${cfg// /_}.log)"
    fi
    runs=$((runs + 1))
  done
  echo "iteration $i of $N: $runs runs, $failures failed"
done
rm -rf "$OUT/run"
echo "$runs torchrun runs with the suite alongside: $failures failed (logs in $OUT)"
[ "$failures" -eq 0 ]

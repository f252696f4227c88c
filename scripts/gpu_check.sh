#!/usr/bin/env bash
# The GPU checks of witness in one go, on a machine with NVIDIA GPUs and PyTorch installed: the
# CUDA tests (tests/test_device.py), then bench/gpu_witnessed.py, then bench/gpu_tree.py (the Triton
# BLAKE3 tree's GB/s and the whole-state commit at 124 M and 1.2 B parameters). Logs and figures go to
# OUTDIR: machine.txt, tests.log, bench.log, gpu_witnessed.json (written after every phase), tree.log
# and gpu_tree.json.
#
#   scripts/gpu_check.sh OUTDIR [bench options, e.g. --presets gpt2-small --steps 8]
#
# It uses the python3 (or $PYTHON) that holds the machine's own torch and runs witness from this
# checkout. On a machine that cannot reach a package index, point WITNESS_WHEELS at a folder of
# wheels of whatever that python lacks (scripts/gpu_wheels.sh fetches the usual ones elsewhere).
# GPUS (default 1) GPUs train under torchrun; TEST_TIMEOUT and BENCH_TIMEOUT bound each part.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [bench options]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if [ -n "${WITNESS_WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WITNESS_WHEELS"/*.whl || exit 1
  export PYTHONPATH="$site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# fewer stranded blocks between the presets' very different allocations
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
  "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  "$py" -c "import witness, blake3, cryptography; print('witness', witness.__version__)"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -p no:cacheprovider -q -rs tests/test_device.py 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
(cd bench && timeout "${BENCH_TIMEOUT:-420}" "$py" -m torch.distributed.run --standalone \
  --nproc_per_node="${GPUS:-1}" gpu_witnessed.py --json "$out/gpu_witnessed.json" "$@") 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
(cd bench && timeout "${TREE_TIMEOUT:-150}" "$py" gpu_tree.py --json "$out/gpu_tree.json") 2>&1 | tee "$out/tree.log"
tree=${PIPESTATUS[0]}
echo "tests: exit $tests; benchmark: exit $bench; tree: exit $tree"
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$tree" = 0 ]

#!/usr/bin/env bash
# The checks that need an accelerator, in one run of a few minutes: the CUDA tests, the
# kernel launches of one update, every batch size against the seed, the parts of the
# update, a short Trainer run and the cost of segment labels.
#
#   bash scripts/device_checks.sh [cuda|cpu] [log folder]
#
# With `cpu` the same steps run on the CPU (the CUDA tests are then skipped): a dry run
# of the script itself. Each step's output goes to the terminal and to
# `<log folder>/<step>.log` (by default `$OUT` when set, else `device-checks/`); a step
# that fails is reported at the end and does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
device="${1:-cuda}"
logs="${2:-${OUT:-device-checks}}"
case "$device" in
  cuda) accelerator=gpu ;;
  cpu) accelerator=cpu ;;
  *) echo "device must be cuda or cpu, got '$device'" >&2; exit 2 ;;
esac
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
failed=()

step() {  # step NAME COMMAND...
  local name="$1"
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status after $((SECONDS - start)) s"
  [ "$status" -eq 0 ] || failed+=("$name")
}

step environment "$python" -c "import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
# In one process, without the project's addopts (two pytest-xdist workers): the CUDA tests
# count launches and synchronisations with the GPU to themselves, and need no xdist.
step tests "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra \
  tests/test_cuda.py tests/test_host_sync.py tests/test_tensorboard.py
step launches "$python" benchmarks/bench_launches.py --device "$device" --names
step sizes "$python" benchmarks/bench_sizes.py --device "$device" --repeats 5 --largest 512x8192
step update_parts "$python" benchmarks/bench_update_parts.py --device "$device" --rounds 50
step trainer "$python" benchmarks/bench_trainer.py --accelerator "$accelerator" --rounds 2
step segments "$python" benchmarks/bench_segments.py --device "$device" --rounds 5 --updates 16 \
  --kinds none,turns,random

if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all steps passed"

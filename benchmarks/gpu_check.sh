#!/usr/bin/env bash
# One command for a GPU (issue 27): everything acshim's CUDA offload path still has to prove on real
# hardware, in at most 8 minutes on one H100 (every step has its own time limit; they sum to 460 s),
# results in one folder:
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # default benchmarks/results/gpu_check
#
# 1. the `cuda` tests (tests/storage/test_cuda.py), then again under TORCH_CUDA_SANITIZER=1 (on torch
#    2.11 its trace hook breaks dropout in a non-reentrant recompute, plain torch's too: docs/gpu.md);
# 2. benchmarks/gpu_probe.py: pinned bandwidth (the copy_ call's host time against the copy's own),
#    exactness on large tensors, under bf16 autocast, after dropped and partial graphs, on cuda:1
#    when present, reserved memory against torch's save_on_cpu and torchtune's OffloadActivations;
# 3. benchmarks/gpu_planner.py: acshim.plan and acshim run --budget on GPT-2, predicted against
#    reserved memory;
# 4. benchmarks/bench_gpu.py on GPT-2 (12 x 768, batch 8 x 512).
#
# Each step writes OUT_DIR/<step>.log; OUT_DIR/summary.txt lists each step's exit status and time.
# Exit status: 0 if every step passed. Without a GPU (or with ACSHIM_GPU_CHECK_DRY=1) it prints what it
# would run and "no GPU: skipped", and exits 0. PYTHON picks the interpreter (default: python).
set -u

cd "$(dirname "$0")/.." || exit 1
OUT=${1:-benchmarks/results/gpu_check}
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's acshim, installed or not

STEPS=(
  "cuda-tests|60|$PY -m pytest -p no:xdist -p no:cacheprovider -q -m cuda tests/storage/test_cuda.py"
  "cuda-tests-sanitizer|90|env TORCH_CUDA_SANITIZER=1 $PY -m pytest -p no:xdist -p no:cacheprovider -q -m cuda tests/storage/test_cuda.py"
  "probe|60|$PY benchmarks/gpu_probe.py --out $OUT/probe.json"
  "planner|120|$PY benchmarks/gpu_planner.py --child-timeout 70 --out $OUT/planner.json"
  "bench-gpt2|130|$PY benchmarks/bench_gpu.py --models gpt2 --layers 12 --width 768 --batch 8 --seq 512 --rounds 3 --steps 2 --out $OUT/gpu.md"
)

gpu=0
if [ "${ACSHIM_GPU_CHECK_DRY:-0}" != 1 ] && "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  gpu=1
fi

if [ "$gpu" = 0 ]; then
  echo "would run, results in $OUT:"
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    echo "  [$name, at most ${limit} s] $command"
  done
  echo "no GPU: skipped"
  exit 0
fi

mkdir -p "$OUT"
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.device_count(), 'device(s)')" \
  >"$OUT/device.txt" 2>&1
: >"$OUT/summary.txt"
status=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit command <<<"$step"
  echo "== $name (at most ${limit} s): $command"
  start=$(date +%s)
  # shellcheck disable=SC2086 # the command is a word list on purpose
  timeout --kill-after=10 "$limit" $command >"$OUT/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  tail -n 3 "$OUT/$name.log"
  echo "$name rc=$rc ${seconds}s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
done
echo "results in $OUT"
exit "$status"

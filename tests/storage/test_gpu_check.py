"""``benchmarks/gpu_check.sh`` (issue 27), the one command for a GPU: without one it prints every
step it would run, with its time limit, and "no GPU: skipped", and exits 0; the limits fit the
8 minutes the issue allows; the probe and the benchmark skip the same way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_without_a_gpu_it_prints_what_it_would_run_and_skips(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, ACSHIM_GPU_CHECK_DRY="1")
    done = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "no GPU: skipped"
    steps = re.findall(r"^  \[([\w-]+), at most (\d+) s\] (.+)$", done.stdout, re.M)
    assert [name for name, _, _ in steps] == ["cuda-tests", "cuda-tests-sanitizer", "probe", "planner", "bench-gpt2"]
    assert sum(int(limit) for _, limit, _ in steps) <= 8 * 60 - 20  # startup and summary fit in the rest
    commands = dict((name, command) for name, _, command in steps)
    assert "-m cuda tests/storage/test_cuda.py" in commands["cuda-tests"]
    assert "TORCH_CUDA_SANITIZER=1" in commands["cuda-tests-sanitizer"]
    assert str(out) in commands["probe"] and str(out) in commands["bench-gpt2"]
    assert "--models gpt2" in commands["bench-gpt2"]
    assert str(out) in commands["planner"] and "gpu_planner.py" in commands["planner"]
    assert not out.exists()  # nothing ran, nothing written


def test_the_probe_and_the_benchmark_skip_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    for script in ("gpu_probe.py", "bench_gpu.py", "gpu_planner.py"):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "no GPU: skipped", (script, done.stdout, done.stderr)

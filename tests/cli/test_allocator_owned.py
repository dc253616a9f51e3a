"""``acshim run --budget`` owns its process's C allocator from the start (issue 26 item 1): the mmap
threshold is fixed at 64 KiB through ``mallopt`` before torch is imported, with no ``MALLOC_*``
variable set, so a budget planned against tensors is the memory the process holds. Subprocesses:
the setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from acshim.allocator import invoked_as_budget_command

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "owned"), [
    (["python", "-m", "acshim", "run", "--budget", "0.3", "train.py"], True),
    (["python", "-u", "-m", "acshim", "run", "--report", "--budget=1GiB", "train.py"], True),
    (["/venv/bin/acshim", "plan", "--budget", "0.5", "--", "train.py"], True),
    (["python", "-m", "acshim", "--local_rank=0", "run", "--budget", "0.5", "train.py"], True),
    (["python", "-m", "acshim", "run", "train.py", "--budget", "0.5"], False),  # the script's own argument
    (["python", "-m", "acshim", "run", "--hf", "train.py"], False),
    (["python", "-m", "acshim", "compat"], False),
    (["python", "train.py", "--budget", "0.5"], False),
])
def test_budget_commands_are_recognised_from_the_interpreter_command_line(argv: list[str], owned: bool) -> None:
    assert invoked_as_budget_command(argv) is owned


def _child(code: str, *command: str, tmp_path: Path) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, *command, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, done.stderr[-3000:]  # (a probe that checkpoints nothing then exits 2: nothing to plan)
    return json.loads(results[-1][7:])


PROBE = """
import json, os
import acshim.allocator
import torch
# A freed 8 MiB block raises glibc's default threshold, so the next one comes from the heap and its
# pages stay resident once freed; with the threshold fixed at 64 KiB each is its own mapping, whose
# pages go back to the system when it is freed.
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
x = torch.ones(8 << 20, dtype=torch.uint8); del x
before = rss()
y = torch.ones(8 << 20, dtype=torch.uint8); del y
print("RESULT " + json.dumps({"how": acshim.allocator.how_set(), "kept": rss() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_run_budget_sets_the_threshold_without_any_malloc_variable(tmp_path: Path) -> None:
    """With no MALLOC_* variable, ``acshim run --budget`` (whose plan is made at the script's first
    step) runs the script with the threshold fixed: a large block allocated after one was freed
    leaves nothing resident once freed. A plain ``python`` process keeps glibc's default (the block
    comes from the heap and stays resident), so the difference is acshim's doing."""
    owned = _child(PROBE, "-m", "acshim", "run", "--budget", "0.5", tmp_path=tmp_path)
    assert owned["how"] == "mallopt" and owned["kept"] < 1 << 20, owned
    plain = _child(PROBE, tmp_path=tmp_path)
    assert plain["how"] is None and plain["kept"] >= 7 << 20, plain



CUDA_PROBE = """
import json, os
import acshim.allocator
print("RESULT " + json.dumps({"cuda": acshim.allocator.cuda_how_set(),
                              "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
"""


@pytest.mark.parametrize("users", [None, "max_split_size_mb:128"], ids=["unset", "users-own"])
def test_run_budget_makes_the_cuda_allocator_follow_tensors_unless_the_user_configured_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, users: str | None) -> None:
    """``acshim run --budget`` sets ``expandable_segments:True`` before CUDA can start, so that reserved
    memory (what a GPU budget is of) follows what tensors hold; a user's own allocator setting is
    kept as it is. Without ``--budget`` nothing is set."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if users is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users)
    owned = _child(CUDA_PROBE, "-m", "acshim", "run", "--budget", "0.5", tmp_path=tmp_path)
    if users is None:
        assert owned == {"cuda": "expandable", "conf": "expandable_segments:True"}
    else:
        assert owned == {"cuda": "user", "conf": users}
    plain = _child(CUDA_PROBE, "-m", "acshim", "run", tmp_path=tmp_path)
    assert plain == {"cuda": None, "conf": users}

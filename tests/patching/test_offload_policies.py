"""torch's own CPU-offload policies (``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``
returned by a policy given to ``create_selective_checkpoint_contexts``) really offload under
``acshim.install()`` / ``acshim run``, with or without ``--report``: torch in eager mode recomputes
those ops instead. The tier is ``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR``; on the disk tier
the memory held after forward is no more than full recompute's, gradients bitwise equal."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import acshim
from acshim.patching import torch_route
from acshim.region import STATS, TORCH_CHECKPOINT
from acshim.storage import reset_defaults

REPO = Path(__file__).resolve().parents[2]
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _policy(decision: CheckpointPolicy):
    def policy(ctx, op, *args, **kwargs):
        return decision if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))


def _grads(block: nn.Module, x: torch.Tensor, context_fn=None) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if context_fn is None:
        out = block(x)
    else:
        out = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    out.square().mean().backward()
    return [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("decision", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_install_routes_offload_policies_to_the_tier_bitwise_and_uninstall_restores(tmp_path, monkeypatch,
                                                                                  decision: str) -> None:
    if not hasattr(CheckpointPolicy, decision):
        pytest.skip(f"absent upstream: torch {torch.__version__} has no CheckpointPolicy.{decision}")
    monkeypatch.setenv("ACSHIM_OFFLOAD_STORAGE", "disk")
    monkeypatch.setenv("ACSHIM_OFFLOAD_DIR", str(tmp_path))
    reset_defaults()
    block, x = _block(), torch.randn(32, 64)
    expected = _grads(block, x)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy(getattr(CheckpointPolicy, decision)))
    acshim.install(dialects=["torch"])
    try:
        assert torch_checkpoint.checkpoint is torch_route.routed_checkpoint
        before = STATS.recomputes
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_grads(block, x, context_fn), expected, strict=True))
        assert STATS.recomputes - before == 2  # the engine ran them
        stats = torch_route.policy_scope().stats
        assert stats.storage == "disk" and stats.moved >= 4  # two matmul outputs per call left memory
        before = STATS.recomputes  # a call without a policy stays torch's own under plain acshim run
        block.zero_grad(set_to_none=True)
        torch_checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        assert STATS.recomputes == before
    finally:
        acshim.uninstall()
        reset_defaults()
    assert torch_checkpoint.checkpoint is TORCH_CHECKPOINT
    assert not torch_route._routes.policy_scopes  # uninstall leaves no storage scope behind


SCRIPT = '''
import ctypes, functools, hashlib, sys
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

torch.manual_seed(0)
torch.set_num_threads(1)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))
                       for _ in range(8))
x = torch.randn(1024, 256)


def policy(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


def loss(mode):
    torch.manual_seed(1)
    h = x
    for block in blocks:
        if mode == "recompute":
            h = h + checkpoint(block, h, use_reentrant=False)
        else:
            h = h + checkpoint(block, h, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    return h.square().mean()


loss(sys.argv[1]).backward()  # warm-up: the first step's one-off allocations are not the step's
blocks.zero_grad(set_to_none=True)
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
value = loss(sys.argv[1])
if "acshim" in sys.modules:  # the probe, not the script: copies still in flight (at most the disk tier's
    from acshim.backends.cpu import wait_for_copies  # 8 MiB bound) land first, so a loaded machine's
    wait_for_copies()  # slower writer does not count as memory the tier keeps
held = status("VmRSS:") - base
value.backward()
print("HELD", held)
print("GRADS", hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in blocks.parameters())).hexdigest())
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure RSS")
def test_unchanged_script_offloads_under_acshim_run_and_disk_holds_no_more_than_recompute(tmp_path) -> None:
    """8 blocks whose matmul outputs the policy marks MUST_CPU_OFFLOAD: plain torch recomputes them
    (held as full recompute); ``acshim run`` with the host tier on CPU keeps them in place (CPU
    memory is the host tier), with ``ACSHIM_OFFLOAD_STORAGE=disk`` they leave memory, with and
    without ``--report``, which names the dialect; gradients bitwise equal throughout."""
    (tmp_path / "train.py").write_text(SCRIPT)
    runs = {"recompute": ([], "recompute", ""), "torch": ([], "policy", ""),
            "host": (["-m", "acshim", "run"], "policy", ""), "disk": (["-m", "acshim", "run"], "policy", "disk"),
            "disk-report": (["-m", "acshim", "run", "--report"], "policy", "disk")}
    held, digests, outputs = {}, set(), {}
    for name, (prefix, mode, storage) in runs.items():
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ACSHIM_OFFLOAD_STORAGE": storage,
               "ACSHIM_OFFLOAD_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
                   "PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, *prefix, "train.py", mode], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("HELD", "GRADS")))
        held[name], outputs[name] = int(lines["HELD"]), done.stderr
        digests.add(lines["GRADS"])
    assert len(digests) == 1, held  # bitwise equal in every run
    matmul_outputs = 8 * 1024 * (1024 + 256) * 4
    assert held["host"] > held["recompute"] + matmul_outputs // 2, held  # kept in place: CPU is the host tier
    slack = 512 * 1024  # RSS repeats agree to 0.1 MB (docs/measuring.md)
    assert held["disk"] <= held["recompute"] + slack and held["disk-report"] <= held["recompute"] + slack, held
    assert "by torch.utils.checkpoint policy" in outputs["disk-report"]
    assert "disk" in next(line for line in outputs["disk-report"].splitlines() if "by torch.utils.checkpoint" in line)
    print("held after forward (bytes):", held)

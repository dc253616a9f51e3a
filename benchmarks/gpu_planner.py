"""The memory-budget planner on a real GPU (issue 26, item 2): is the predicted peak what the CUDA
caching allocator reserves? Run by ``gpu_check.sh``; a minute or two on one H100.

For HF GPT-2 (``--layers`` x ``--width``, batch ``--batch`` x ``--seq``, dropout on), each row in a
fresh process, the baseline taken after a warm-up step and ``empty_cache`` (parameters, gradients
and inputs held, as in training):

- ``none``: one step without checkpointing; its reserved peak above the baseline is what a fraction
  budget is a fraction of, as the user measures it;
- ``plan:F`` (for every ``--fractions`` F): ``acshim.plan(model, batch, F)``, then ``plan.apply(model)`` and ``--steps`` steps:
  the planner's predicted peak and verified peak against ``max_memory_reserved`` above the baseline
  for the planning call itself and for each step after it;
- ``run:F``: the same loop as a script under ``python -m acshim run --hf --budget F`` (the CLI path
  users take; ``--hf`` checkpoints the model's layers), each step's reserved peak above the first
  step's start (``step_mib``) and above its own start (``own_start_mib``: from the second step on,
  gradients are held at the start, as in the ``none`` row), with the CLI's own report.

Every row's gradients (deterministic kernels, same seed) are hashed and compared with ``none``'s.

    python benchmarks/gpu_planner.py --out results/planner.md

Without a GPU it prints "no GPU: skipped" and exits 0. Exit status 1 if a row's gradients differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

MiB = 2**20
VOCAB = 32000


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                     n_positions=args.seq, vocab_size=VOCAB, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config).cuda().train()


def batch_of(args: argparse.Namespace) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(2)).cuda()
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def loss_of(output: Any) -> torch.Tensor:
    return output.loss


def step(model: torch.nn.Module, batch: dict[str, Any]) -> None:
    model.zero_grad(set_to_none=False)
    model(**batch).loss.backward()


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.grad.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def reserved_peak_of(action: Any, base: int) -> tuple[float, float]:
    """``(MiB reserved above base at the peak, seconds)`` of ``action()``; the allocated peak above
    the allocated start goes to ``ALLOCATED`` (the allocator's slack is the difference)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    ALLOCATED.append((torch.cuda.max_memory_allocated() - allocated) / MiB)
    return (torch.cuda.max_memory_reserved() - base) / MiB, time.perf_counter() - start


ALLOCATED: list[float] = []


def expandable() -> bool:
    """Whether the caching allocator made expandable segments (``acshim.allocator`` sets them under
    ``--budget``; a user's ``PYTORCH_CUDA_ALLOC_CONF`` is kept)."""
    return any(segment.get("is_expandable", False) for segment in torch.cuda.memory_snapshot())


def warm(model: torch.nn.Module, batch: dict[str, Any]) -> int:
    """One step (kernels, gradients), then the cache emptied: the baseline a budget is above."""
    step(model, batch)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def row_none(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args), batch_of(args)
    base = warm(model, batch)
    torch.manual_seed(1)
    peak, seconds = reserved_peak_of(lambda: step(model, batch), base)
    steps = [reserved_peak_of(lambda: step(model, batch), base)[1] for _ in range(args.steps)]
    torch.manual_seed(1)
    step(model, batch)
    return {"row": "none", "step_mib": [peak], "allocated_mib": ALLOCATED[:1], "step_s": min(steps),
            "grads": fingerprint(model), "expandable": expandable()}


def row_plan(args: argparse.Namespace, fraction: float) -> dict[str, Any]:
    import acshim

    model, batch = build(args), batch_of(args)
    base = warm(model, batch)
    found: list[Any] = []

    def planning() -> None:
        try:
            found.append(acshim.plan(model, batch, fraction, loss_fn=loss_of))
        except ValueError as refused:  # BudgetTooSmall or no plan measured within it: a finding, not a crash
            found.append(refused)

    planning_mib, planning_s = reserved_peak_of(planning, base)
    plan = found[0]
    if isinstance(plan, ValueError):
        return {"row": f"plan:{fraction}", "refused": str(plan), "planning_mib": planning_mib,
                "planning_s": planning_s}
    plan.apply(model)
    step_mib, times = [], []
    for _ in range(args.steps):
        mib, seconds = reserved_peak_of(lambda: step(model, batch), base)
        step_mib.append(mib)
        times.append(seconds)
    torch.manual_seed(1)
    step(model, batch)
    return {"row": f"plan:{fraction}", "budget_mib": plan.budget / MiB,
            "reference_mib": plan.reference_peak / MiB, "predicted_mib": plan.peak / MiB, "verified_mib": (plan.measured_process_peak or 0) / MiB,
            "choices": plan.describe(), "planning_mib": planning_mib, "planning_s": planning_s,
            "step_mib": step_mib, "planning_allocated_mib": ALLOCATED[0], "allocated_mib": ALLOCATED[1:],
            "step_s": min(times), "grads": fingerprint(model),
            "expandable": expandable()}


SCRIPT = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from gpu_planner import build, batch_of, step, fingerprint, expandable, MiB
import argparse
torch.use_deterministic_algorithms(True)
args = argparse.Namespace(**json.loads({shape!r}))
model, batch = build(args), batch_of(args)
peaks, own, allocated = [], [], []
for index in range({steps}):
    torch.cuda.synchronize(); base = torch.cuda.memory_reserved() if index == 0 else base
    start = torch.cuda.memory_reserved()
    first = torch.cuda.memory_allocated() if index == 0 else first
    torch.cuda.reset_peak_memory_stats()
    if index == {steps} - 1:
        torch.manual_seed(1)
    step(model, batch)
    torch.cuda.synchronize()
    peaks.append((torch.cuda.max_memory_reserved() - base) / MiB)
    own.append((torch.cuda.max_memory_reserved() - start) / MiB)
    allocated.append((torch.cuda.max_memory_allocated() - first) / MiB)
print("RESULT " + json.dumps({{"step_mib": peaks, "own_start_mib": own, "allocated_mib": allocated,
                               "grads": fingerprint(model), "expandable": expandable()}}))
"""


def row_run(args: argparse.Namespace, fraction: float) -> dict[str, Any]:
    shape = json.dumps({k: getattr(args, k) for k in ("layers", "width", "batch", "seq")})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as handle:
            handle.write(SCRIPT.format(bench=os.path.dirname(os.path.abspath(__file__)), shape=shape,
                                       steps=args.steps + 2))
        done = subprocess.run([sys.executable, "-m", "acshim", "run", "--hf", "--budget", str(fraction), path],
                              capture_output=True, text=True, timeout=args.child_timeout)
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), {})
    report = [line for line in done.stderr.splitlines() if "acshim" in line][-8:]
    return {"row": f"run:{fraction}", "returncode": done.returncode, "report": report, **result}


def child(args: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True)
    name = args.row
    if name == "none":
        result = row_none(args)
    elif name.startswith("plan:"):
        result = row_plan(args, float(name[5:]))
    else:
        result = row_run(args, float(name[4:]))
    print("RESULT " + json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.3])
    parser.add_argument("--child-timeout", type=int, default=120)
    parser.add_argument("--kinds", nargs="+", choices=("plan", "run"), default=["plan", "run"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    if args.row:
        child(args)
        return 0
    rows = ["none", *(f"{kind}:{f}" for f in args.fractions for kind in args.kinds)]
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch), "--seq",
             str(args.seq), "--steps", str(args.steps), "--child-timeout", str(args.child_timeout)]
    results = []
    for row in rows:
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *shape, "--row", row],
                                  capture_output=True, text=True, timeout=args.child_timeout + 30)
        except subprocess.TimeoutExpired:
            results.append({"row": row, "error": "timed out"})
            continue
        found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(found[0] if found else {"row": row, "error": done.stderr[-3000:]})
        print(json.dumps(results[-1]), flush=True)
    expected = results[0].get("grads")
    exact = all(r.get("grads") == expected for r in results if "grads" in r) and expected is not None
    print(f"gradients bitwise equal across rows: {exact}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results},
                      handle, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

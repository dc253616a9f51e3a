"""``bench_planner.py --compile``: acshim plans under ``torch.compile`` beside torch's
``activation_memory_budget``, at equal peak.

Torch's budget (``torch._functorch.config.activation_memory_budget``, compile-only: AOTAutograd's
min-cut partitioner recomputes ops so that the compiled graph saves that fraction of what it saves by
default) is set to each of ``--torch-budgets`` (0.5, 0.25, 0.1) on the model without checkpointing.
For each, the peak of the compiled step is measured; then ``acshim.plan`` is asked for a plan with
that peak as its budget (if the planner cannot meet it: the smallest budget above it that it meets,
taken from the base plan's frontier), the plan is applied to a fresh model and the planned model is
compiled the same way (same backend; torch's budget left at its default 1.0). Reported per
configuration: peak as a ratio of no checkpointing's eager peak, step time as a ratio of no
checkpointing compiled, and the bytes the step saves for backward (an outer ``saved_tensors_hooks``:
sees AOTAutograd's ``save_for_backward`` and eager autograd alike). Plans that come out the same for
two budgets are built, measured and timed once.

Backend: inductor (CPU, C++ kernels) when a C++ compiler exists and a tiny function compiles with it;
else aot_eager (the same partitioner, ops run eagerly), and the output says so. Each configuration
has its own compiled model; torch's budget is patched around the backend call, so it applies to that
configuration's graph only.

How peak is measured, one method for every row, eager or compiled: acshim's op-by-op tracker
(``measure_step``) is a dispatch mode and does not see the buffers inside an inductor kernel, so each
configuration runs in a fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (each allocation over
64 KiB is its own mapping, returned on free; shared/MEASURING.md). After one warm-up step (which
compiles), the heap is trimmed and the high-water mark reset before each measured step; peak =
VmHWM - RSS before the step, the max of two steps. Two variants:

- ``peak`` (the planner's measure): parameter gradients allocated before the baseline
  (``zero_grad(set_to_none=False)``), so they are not counted, as in the planner's budget. For eager
  rows this agrees with the tracker (shown beside). A compiled backward returns all weight gradients
  together at its end, before they are added into ``.grad``: those copies are counted (conservative).
- ``+grads``: a usual step (``zero_grad(set_to_none=True)``): gradients counted as they appear, i.e.
  what the process really peaks at.

Equal peak is matched on ``peak``. Step times: every configuration in this process, interleaved,
order rotated each round, median of per-round ratios (shared/MEASURING.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import acshim
from acshim.planner import BudgetTooSmall, Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planner as bp
import memory_probe

NO_OFFLOAD = ("keep", "selective", "selective-alt", "recompute")
"""Default planner choices here: torch's budget cannot offload, and a region with a storage tier runs
eagerly around a graph break (docs/engine.md); pass ``--choices`` to allow offload."""
MiB = 2**20


# ------------------------------------------------------------------------------------------ compiling
def pick_backend(requested: str) -> tuple[str, str]:
    """``(backend, how it was chosen)``: inductor when asked or when it works here, else aot_eager."""
    if requested != "auto":
        return requested, "as requested"
    compiler = next((found for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++")
                     if name and (found := shutil.which(name))), None)
    if compiler is None:
        return "aot_eager", "FALLBACK: no C++ compiler found, inductor cannot build CPU kernels"
    try:
        torch.compile(lambda x: torch.sin(x) + 1, backend="inductor")(torch.randn(8))
    except Exception as error:  # any failure means inductor cannot run here
        return "aot_eager", f"FALLBACK: inductor failed here ({type(error).__name__}: {str(error)[:200]})"
    return "inductor", f"inductor's CPU kernels built with {compiler}"


def compiler_for(backend: str, budget: float) -> Callable[..., Any]:
    """A ``torch.compile`` backend: ``backend`` with torch's ``activation_memory_budget`` set to
    ``budget`` while it partitions this graph (the partition happens inside the backend call)."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx as inner
    else:
        from torch._dynamo.backends.debugging import aot_eager as inner

    def compile_with_budget(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(graph, example_inputs)

    return compile_with_budget


@dataclass
class Config:
    """A model (an acshim plan applied, if ``plan``), run eagerly or compiled with torch's ``budget``."""

    name: str
    compiled: bool
    budget: float = 1.0  # torch's activation_memory_budget
    plan: str = ""  # path of a saved acshim plan
    results: dict[str, Any] = field(default_factory=dict)

    def build(self, work: bp.Workload, backend: str) -> tuple[nn.Module, Callable[..., Any]]:
        model = work.build()
        if self.plan:
            Plan.load(self.plan).apply(model)
        run = torch.compile(model, backend=compiler_for(backend, self.budget)) if self.compiled else model
        return model, run

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "compiled": self.compiled, "budget": self.budget, "plan": self.plan}


# ------------------------------------------------------------------------------------------ peak (child)
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build the configuration, warm up, measure the peak RSS of steps."""
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    work = bp.workload(args)
    model, run = Config(**spec["config"]).build(work, spec["backend"])
    start = time.perf_counter()
    bp.forward_loss(run, work.batch).backward()  # warm-up; compiles
    warmup = time.perf_counter() - start
    results: dict[str, Any] = {"warmup_seconds": warmup}
    for key, set_to_none in (("peak", False), ("counted", True)):
        peaks = []
        for _ in range(2):
            model.zero_grad(set_to_none=set_to_none)
            memory_probe.reset_high_water_mark()
            baseline = memory_probe.rss_bytes()
            loss = bp.forward_loss(run, work.batch)
            loss.backward()
            del loss
            peaks.append(memory_probe.hwm_bytes() - baseline)
        results[key], results[key + "_repeats"] = max(peaks), peaks
    return results


def rss_peak(args: argparse.Namespace, config: Config, backend: str) -> dict[str, Any]:
    """``child`` for ``config`` in a fresh interpreter (see the module docstring)."""
    spec = {"args": vars(args), "config": config.spec(), "backend": backend}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, capture_output=True, text=True,
                            check=False)
    for line in result.stdout.splitlines():
        if line.startswith("PEAK "):
            return json.loads(line[5:])
    raise RuntimeError(f"peak probe for {config.name} failed:\n{result.stdout}\n{result.stderr[-4000:]}")


def probe_all(args: argparse.Namespace, configs: list[Config], backend: str) -> None:
    """Peaks of ``configs``, ``args.jobs`` fresh processes at a time (peak RSS is per process; only
    compile time is shared)."""
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for config, results in zip(configs, pool.map(lambda c: rss_peak(args, c, backend), configs), strict=True):
            config.results.update(results)


def saved_bytes(model: nn.Module, run: Callable[..., Any], batch: Any) -> int:
    """Bytes of distinct storages saved for backward in one step (parameters and inputs excluded)."""
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded |= {t.untyped_storage().data_ptr() for t in (batch.values() if isinstance(batch, dict) else [batch])}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = bp.forward_loss(run, batch)
    loss.backward()
    return sum(saved.values())


# ------------------------------------------------------------------------------------------ the run
def plan_at(model: nn.Module, batch: Any, peak: int, base: Plan, choices: tuple[str, ...]) -> tuple[Plan, str]:
    """The plan at the smallest budget >= ``peak`` that acshim.plan meets (``peak`` itself, else the
    next budgets of the base plan's frontier), and why the budget was raised, if it was."""
    candidates = [peak] + sorted(p.budget for p in base.frontier() if p.budget > peak)
    errors = []
    for budget in candidates:
        try:
            return acshim.plan(model, batch, budget=budget, reuse=base, choices=choices), "; ".join(errors)
        except BudgetTooSmall as error:
            errors.append(f"{budget / MiB:.1f} MiB is below the least achievable {error.minimum / MiB:.1f} MiB")
        except ValueError as error:
            errors.append(f"{budget / MiB:.1f} MiB: {error}")
    raise ValueError(f"no acshim plan at or above {peak / MiB:.1f} MiB: {'; '.join(errors)}")


@dataclass
class Pair:
    """Torch's budget and the acshim plan at its peak (compiled, and the same plan eager)."""

    torch: Config
    plan: Plan | None = None
    note: str = ""
    compiled: Config | None = None
    eager: Config | None = None


def plan_pairs(model: nn.Module, batch: Any, pairs: list[Pair], choices: tuple[str, ...], folder: Path
               ) -> list[Config]:
    """For each pair, the acshim plan at torch's measured peak (one profile, solved per budget); the
    configurations to run, compiled and eager, once per distinct plan (saved in ``folder``)."""
    base = acshim.plan(model, batch, budget=1.0, choices=choices)  # profiles once; solved again per budget
    by_choices: dict[tuple[tuple[str, ...], str], tuple[Config, Config]] = {}
    for pair in pairs:
        try:
            pair.plan, pair.note = plan_at(model, batch, pair.torch.results["peak"], base, choices)
        except ValueError as error:
            pair.note = str(error)
            continue
        key = (tuple(pair.plan.choices), pair.plan.outside)
        if key not in by_choices:
            path = folder / f"plan_{len(by_choices)}.json"
            pair.plan.save(path)
            label = "acshim " + bp._label(*key)
            by_choices[key] = (Config(label, compiled=True, plan=str(path)),
                               Config(label + " (eager)", compiled=False, plan=str(path)))
        pair.compiled, pair.eager = by_choices[key]
    return [config for both in by_choices.values() for config in both]


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_planner_compile_") as folder:  # the plans, for the probes
        run_in(args, Path(folder))


def run_in(args: argparse.Namespace, folder: Path) -> None:
    torch._dynamo.config.recompile_limit = 64  # one cache entry per configuration's model
    backend, how = pick_backend(args.backend)
    choices = bp.planner_choices(args, NO_OFFLOAD)
    work = bp.workload(args)
    batch = work.batch
    model = work.build()  # eager: the tracker's figures and planning
    tracker_none = bp.measure(model, batch)[1]
    start = time.perf_counter()

    none_eager, none_compiled = Config("none (eager)", compiled=False), Config("none compiled", compiled=True)
    pairs = [Pair(Config(f"torch budget {b:.2f}", compiled=True, budget=b)) for b in map(float, args.torch_budgets.split(","))]
    probe_all(args, [none_eager, none_compiled, *[p.torch for p in pairs]], backend)
    probes = time.perf_counter() - start

    mine = plan_pairs(model, batch, pairs, choices, folder)
    planning = time.perf_counter() - start - probes
    probe_all(args, mine, backend)
    probes = time.perf_counter() - start - planning  # both rounds of probes

    # Step times: each configuration built (and compiled: cache hits after the probes) once here.
    configs = [none_eager, none_compiled, *[p.torch for p in pairs], *mine]
    built = {config.name: config.build(work, backend) for config in configs}
    for config in configs:
        owner, runner = built[config.name]
        config.results["saved"] = saved_bytes(owner, runner, batch)  # also this process's compile

    def prepare(name: str) -> bp.Step:
        owner, runner = built[name]

        def step() -> None:
            owner.zero_grad(set_to_none=True)
            bp.forward_loss(runner, batch).backward()
        return step

    ratios = bp.interleaved([c.name for c in configs], prepare, args.rounds, reference="none compiled")
    steps = {name: statistics.median(values) for name, values in ratios.items()}
    total = time.perf_counter() - start

    print(bp.header(args, work))
    print(f"torch.compile backend: {backend} ({how}); acshim planner choices: {','.join(choices)}")
    report(configs, pairs, steps, tracker_none)
    print(f"time: peak probes {probes:.0f} s ({args.jobs} at a time), planning {planning:.0f} s, total {total:.0f} s; "
          "warm-up (compile) in the probes: "
          + ", ".join(f"{c.name} {c.results['warmup_seconds']:.0f} s" for c in configs if c.compiled))


def report(configs: list[Config], pairs: list[Pair], steps: dict[str, float], tracker_none: int) -> None:
    """The table (configs[0] is none eager: the peaks' reference) and the side-by-side lines."""
    none_eager = configs[0]
    ref, ref_counted = none_eager.results["peak"], none_eager.results["counted"]
    print("peak: peak RSS of one step in a fresh process (MALLOC_MMAP_THRESHOLD_=65536), max of 2 steps, x none "
          "(eager)'s; 'peak': gradients allocated before the step (not counted, the planner's measure), '+grads': "
          "zero_grad(set_to_none=True) (counted); step: median of per-round ratios to none compiled")
    print(f"none (eager): peak {ref / MiB:.1f} MiB, +grads {ref_counted / MiB:.1f} MiB; acshim's tracker "
          f"(measure_step, eager only) {tracker_none / MiB:.1f} MiB")
    print(f"{'configuration':<34} {'peak MiB':>8} {'peak x':>6} {'+grads x':>8} {'budget MiB':>10} {'within':>6} "
          f"{'step x':>6} {'saved MiB':>9}  notes")
    plans: dict[str, Plan] = {}  # a plan serving several budgets is checked against the tightest
    for pair in sorted(pairs, key=lambda p: -p.plan.budget if p.plan else 0):
        for config in (pair.compiled, pair.eager):
            if config is not None and pair.plan is not None:
                plans[config.name] = pair.plan
    for config in configs:
        peak, found, budget, within, extra = config.results["peak"], plans.get(config.name), "", "", ""
        if found is not None:
            budget, within = f"{found.budget / MiB:.1f}", ("yes" if peak <= found.budget else "NO")
            if not config.compiled:
                extra = f"tracker peak {(found.measured_peak or 0) / MiB:.1f} MiB"
        print(f"{config.name:<34} {peak / MiB:>8.1f} {peak / ref:>6.2f} {config.results['counted'] / ref_counted:>8.2f} "
              f"{budget:>10} {within:>6} {steps[config.name]:>6.2f} {config.results['saved'] / MiB:>9.1f}  {extra}")
    print("side by side at equal peak (peak x none eager, step x none compiled):")
    for pair in pairs:
        if pair.compiled is None or pair.plan is None:
            print(f"  torch {pair.torch.budget:.2f}: peak {pair.torch.results['peak'] / ref:.2f}, step "
                  f"{steps[pair.torch.name]:.2f}  |  acshim: NO PLAN: {pair.note}")
            continue
        raised = f"; budget raised: {pair.note}" if pair.note else ""
        within = "within" if pair.compiled.results["peak"] <= pair.plan.budget else "OVER"
        print(f"  torch {pair.torch.budget:.2f}: peak {pair.torch.results['peak'] / ref:.2f}, step "
              f"{steps[pair.torch.name]:.2f}  |  {pair.compiled.name}: peak {pair.compiled.results['peak'] / ref:.2f} "
              f"({within} its budget {pair.plan.budget / MiB:.1f} MiB = torch's peak{' or above' if pair.note else ''}), "
              f"step {steps[pair.compiled.name]:.2f}{raised}")


if __name__ == "__main__":
    print("PEAK " + json.dumps(child(json.loads(sys.argv[1]))))

"""Benchmark: the memory-budget planner (acshim.plan) beside the fixed recipes.

One language model, one process, configurations interleaved with the order rotated every round.
``--model gpt`` (default): ``acshim.testing.GPT``, GPT-2-shaped, 8 layers x 512, seq 256, batch 2,
vocab 512 as in benchmarks/bench_checkpoint.py, dropout on. ``--model llama``: a Hugging Face
``LlamaForCausalLM`` of the same size from a small ``LlamaConfig`` with random weights (8 layers,
hidden 512, 8 heads, 8 key/value heads, SwiGLU intermediate 1376, vocab 512, sdpa attention,
``use_cache=False``; Llama has no dropout), trained on ``{"input_ids", "labels"}``; nothing is
downloaded. On both models the baselines use acshim's own calls (``acshim.apply_checkpointing``,
which finds the repeated blocks: ``h.N`` for GPT, ``model.layers.N`` for Llama), not transformers'
``gradient_checkpointing_enable``.

Per configuration: bytes held for backward when forward ends and the step's peak activation memory
(acshim.planner.measure_step: live storages op by op, parameter gradients and inputs excluded), as
ratios of no checkpointing's, and the median of per-round step-time ratios. Configurations: none,
full recompute per block, selective-op (save matmul/attention outputs), disk offload alone around
the step (prefetch 2), and plans at several peak budgets (fractions of none's measured peak). Also:
planning time (profiling + solving + verification) in steps of none, each plan's own prediction
(peak and step time as ratios of its predicted no checkpointing) beside what was measured, and the
planner's predicted frontier.

``--sweep``: the 10 budgets of one plan's ``frontier()``; for every point the plan
``acshim.plan(model, batch, budget=point.budget, reuse=base)`` returns (the base plan's profile solved
again and verified, no new profiling) is applied, measured (peak) and timed beside the baselines.
Checks: every point at or under its budget; step time monotone in budget; for every baseline a plan
point at or below it (peak <= the baseline's, step <= the baseline's). Step-time comparisons allow
``--tolerance`` (default 5%: the spread of one configuration here is about 5-10%, see
shared/MEASURING.md); peaks are exact byte counts and compared without tolerance.

``--compile``: acshim plans under ``torch.compile`` beside torch's ``activation_memory_budget``
(see benchmarks/bench_planner_compile.py).

    python benchmarks/bench_planner.py                    # full size, GPT
    python benchmarks/bench_planner.py --model llama      # full size, Llama
    python benchmarks/bench_planner.py --small --sweep    # quick check of the frontier sweep
    python benchmarks/bench_planner.py --small --compile  # quick check under torch.compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import acshim
from acshim.measure import default_loss
from acshim.planner import BASE_CHOICES, Plan, measure_step
from acshim.selective import save_ops
from acshim.testing import GPT, seeded

Step = Callable[[], None]
Scope = Callable[[], AbstractContextManager[Any]]
Recipe = tuple[Callable[[nn.Module], Any], Scope]  # (install on a model, scope around forward)
BASELINES = ("none", "full recompute", "selective-op", "disk offload alone")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt", "llama", "lora"), default="gpt",
                        help="lora: fine-tuning, LoRA adapters (PEFT) on a frozen Llama with a big vocabulary "
                             "(defaults 4x128, seq 128, vocab 32000, budgets 0.5,0.35)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=0,
                        help="Llama's MLP width (default: 8/3 x width rounded up to a multiple of 32; 1376 at 512)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", default="0.7,0.47,0.35,0.23,0.16",
                        help="peak budgets as fractions of no checkpointing's measured peak")
    parser.add_argument("--small", action="store_true", help="4 layers, width 128, seq 64, vocab 512, 3 rounds")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="measure every point of one plan's frontier()")
    mode.add_argument("--compile", action="store_true",
                      help="under torch.compile, beside torch's activation_memory_budget")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="relative step-time noise allowed by --sweep's checks (default 0.05)")
    parser.add_argument("--torch-budgets", default="0.5,0.25,0.1",
                        help="--compile: torch activation_memory_budget values")
    parser.add_argument("--backend", choices=("auto", "inductor", "aot_eager"), default="auto",
                        help="--compile: backend (auto: inductor if it compiles here, else aot_eager)")
    parser.add_argument("--jobs", type=int, default=2, help="--compile: peak probes (subprocesses) run at once")
    parser.add_argument("--choices", default="",
                        help="planner choices, comma-separated (default: acshim's; --compile: no offload)")
    args = parser.parse_args(argv)
    if args.model == "lora":
        given = set(argv)
        for flag, name, value in (("--layers", "layers", 4), ("--width", "width", 128), ("--seq", "seq", 128),
                                  ("--vocab", "vocab", 32000), ("--budgets", "budgets", "0.5,0.35")):
            if flag not in given:
                setattr(args, name, value)
    if args.small:
        args.layers, args.width, args.seq, args.vocab, args.rounds = 4, 128, 64, 512, 3
    if not args.intermediate:
        args.intermediate = -(-args.width * 8 // 3 // 32) * 32
    return args


# ------------------------------------------------------------------------------------------ workload
@dataclass
class Workload:
    """A model family at one size: ``build()`` makes a fresh seeded instance in train mode, ``batch``
    is its input (a tensor for GPT, keyword inputs with labels for Hugging Face)."""

    label: str
    build: Callable[[], nn.Module]
    batch: Any


def workload(args: argparse.Namespace) -> Workload:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    heads = max(1, args.width // 64)
    shape = f"{args.layers}x{args.width}, batch {args.batch}x{args.seq}, vocab {args.vocab}"
    if args.model == "gpt":
        return Workload(f"GPT {shape}, dropout on",
                        lambda: seeded(lambda: GPT(args.layers, args.width, heads, args.seq, args.vocab)), ids)

    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=args.seq, attention_dropout=0.0, use_cache=False)
    config._attn_implementation = "sdpa"

    def build() -> nn.Module:
        model = seeded(lambda: transformers.LlamaForCausalLM(config))
        if args.model == "lora":
            import peft

            lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, task_type="CAUSAL_LM",
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"])
            model = seeded(lambda: peft.get_peft_model(model, lora))
        model.train()
        return model

    if args.model == "lora":
        return Workload(f"LoRA fine-tuning (PEFT r=8 on every projection, frozen HF LlamaForCausalLM, transformers "
                        f"{transformers.__version__}) {shape}, intermediate {args.intermediate}, LoRA dropout 0.1",
                        build, {"input_ids": ids, "labels": ids})
    return Workload(f"Llama (HF LlamaForCausalLM, transformers {transformers.__version__}) {shape}, "
                    f"intermediate {args.intermediate}, no dropout", build, {"input_ids": ids, "labels": ids})


def forward_loss(model: Callable[..., Any], batch: Any) -> torch.Tensor:
    """The loss of one forward: ``model(**batch)`` for keyword inputs, else ``model(batch)``."""
    return default_loss(model(**batch) if isinstance(batch, dict) else model(batch))


def make_step(model: nn.Module, batch: Any, scope: Scope = nullcontext) -> Step:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with scope():
            loss = forward_loss(model, batch)
        loss.backward()
    return step


class _Scoped(nn.Module):
    """``model`` with ``scope`` around its forward only, as a user would write it."""

    def __init__(self, model: nn.Module, scope: Scope) -> None:
        super().__init__()
        self.inner, self.scope = model, scope

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.scope():
            return self.inner(*args, **kwargs)


def measure(model: nn.Module, batch: Any, scope: Scope = nullcontext) -> tuple[int, int]:
    """``(held after forward, peak)`` activation bytes of one step (acshim.planner.measure_step)."""
    model.zero_grad(set_to_none=True)
    return measure_step(model if scope is nullcontext else _Scoped(model, scope), batch)


def recipes() -> dict[str, Recipe]:
    """The fixed recipes, each as (install on a model, scope around its forward)."""
    offload_scope: Scope = lambda: acshim.offload(storage="disk", prefetch=2)  # noqa: E731
    return {
        "none": (acshim.remove_checkpointing, nullcontext),
        "full recompute": (acshim.apply_checkpointing, nullcontext),
        "selective-op": (lambda model: acshim.apply_checkpointing(model, context_fn=save_ops()), nullcontext),
        "disk offload alone": (acshim.remove_checkpointing, offload_scope),
    }


def plan_recipe(found: Plan) -> Recipe:
    return found.apply, nullcontext


def measure_recipes(model: nn.Module, batch: Any, named: dict[str, Recipe]) -> dict[str, tuple[int, int]]:
    """Install each recipe in turn, warm up one step, measure (held, peak); the model is left bare."""
    memory = {}
    for name, (install, scope) in named.items():
        acshim.remove_checkpointing(model)
        install(model)
        make_step(model, batch, scope)()  # warm up
        memory[name] = measure(model, batch, scope)
    acshim.remove_checkpointing(model)
    return memory


def interleaved(names: list[str], prepare: Callable[[str], Step], rounds: int, reference: str = "none"
                ) -> dict[str, list[float]]:
    """Per-round step-time ratios to ``reference``: every round runs each configuration once, the
    order rotated each round; ``prepare(name)`` (untimed) installs it and returns its step."""
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        seconds = {}
        for name in order:
            step = prepare(name)
            start = time.perf_counter()
            step()
            seconds[name] = time.perf_counter() - start
        for name in names:
            ratios[name].append(seconds[name] / seconds[reference])
    return ratios


def time_recipes(model: nn.Module, batch: Any, named: dict[str, Recipe], rounds: int) -> dict[str, float]:
    """Median step-time ratio to ``none`` of each recipe, on the one model re-installed each time."""
    def prepare(name: str) -> Step:
        install, scope = named[name]
        acshim.remove_checkpointing(model)
        install(model)
        return make_step(model, batch, scope)

    ratios = interleaved(list(named), prepare, rounds)
    acshim.remove_checkpointing(model)
    return {name: statistics.median(values) for name, values in ratios.items()}


def header(args: argparse.Namespace, work: Workload) -> str:
    return (f"{work.label}; torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds")


def planner_choices(args: argparse.Namespace, default: tuple[str, ...] = BASE_CHOICES
                    ) -> tuple[str, ...]:
    return tuple(c.strip() for c in args.choices.split(",") if c.strip()) or default


# ------------------------------------------------------------------------------------------ default mode
def budgets_table(args: argparse.Namespace, work: Workload) -> None:
    model = work.build()
    batch = work.batch
    fixed = recipes()
    memory = measure_recipes(model, batch, fixed)
    none_held, none_peak = memory["none"]
    step_none = make_step(model, batch)
    start = time.perf_counter()
    step_none()
    none_seconds = time.perf_counter() - start

    plans: dict[str, Plan] = {}
    fractions = [float(f) for f in args.budgets.split(",")]
    start = time.perf_counter()
    first: Plan | None = None
    planning_seconds = 0.0
    for fraction in fractions:
        budget = int(fraction * none_peak)
        try:
            found = acshim.plan(model, batch, budget=budget, reuse=first, choices=planner_choices(args))
        except ValueError as error:
            print(f"budget {fraction:.2f}x: {error}")
            continue
        if first is None:
            first = found
            planning_seconds = time.perf_counter() - start
        plans[f"plan @ {fraction:.2f}x"] = found
    named = {**fixed, **{name: plan_recipe(found) for name, found in plans.items()}}
    memory.update(measure_recipes(model, batch, {name: plan_recipe(found) for name, found in plans.items()}))
    steps = time_recipes(model, batch, named, args.rounds)

    print(header(args, work))
    print(f"no checkpointing: held {none_held / 2**20:.1f} MiB, peak {none_peak / 2**20:.1f} MiB")
    print(f"{'configuration':<22} {'held x':>7} {'peak x':>7} {'step x':>7}  {'within budget':>13}  "
          f"{'predicted peak x, step x':>24}  choices")
    for name in named:
        held, peak = memory[name]
        found = plans.get(name)
        within = "" if found is None else ("yes" if peak <= found.budget else "NO")
        choices = "" if found is None else _label(found.choices, found.outside)
        # the planner's own prediction, as ratios of its predicted no checkpointing (never run)
        predicted = "" if found is None else (f"{found.peak / found.reference_peak:.2f}, "
                                              f"{found.seconds / found.reference_seconds:.2f}")
        print(f"{name:<22} {held / none_held:>7.2f} {peak / none_peak:>7.2f} "
              f"{steps[name]:>7.2f}  {within:>13}  {predicted:>24}  {choices}")
    if first is not None:
        print(f"planning (profile + solve + verify): {planning_seconds:.1f} s = "
              f"{planning_seconds / none_seconds:.1f} steps of no checkpointing")
        print("predicted frontier (budget x, peak x, step x of predicted no checkpointing):")
        for point in first.frontier():
            print(f"  {point.budget / first.reference_peak:.2f}  {point.peak / first.reference_peak:.2f}  "
                  f"{point.seconds / first.reference_seconds:.2f}  {_label(point.choices, point.outside)}")


# ------------------------------------------------------------------------------------------ --sweep
@dataclass
class SweepPoint:
    budget: int
    predicted: list[str]  # the frontier point's choices
    predicted_outside: str  # and its choice for the part outside the blocks
    plan: Plan | None  # what acshim.plan returned for this budget (None: no plan measured within it)
    error: str = ""
    measured_peak: int = 0  # the bench's own measurement of plan (or, without a plan, of predicted)
    step: float = 0.0

    @property
    def under(self) -> bool:
        return self.plan is not None and self.measured_peak <= self.budget


def sweep(args: argparse.Namespace, work: Workload) -> None:
    model, batch, tol = work.build(), work.batch, args.tolerance
    fixed = recipes()
    memory = measure_recipes(model, batch, fixed)
    none_peak = memory["none"][1]
    choices = planner_choices(args)
    start = time.perf_counter()
    base = acshim.plan(model, batch, budget=1.0, choices=choices)  # profiles; budget 1.0: all kept
    profiling = time.perf_counter() - start
    points: list[SweepPoint] = []
    for point in base.frontier():
        try:
            found = acshim.plan(model, batch, budget=point.budget, reuse=base, choices=choices)
            points.append(SweepPoint(point.budget, point.choices, point.outside, found))
        except ValueError as error:
            points.append(SweepPoint(point.budget, point.choices, point.outside, None, str(error)))

    # One configuration per distinct set of choices; a point without a plan is measured (not timed)
    # as the frontier predicted it, to show by how much it is over.
    configs: dict[str, Recipe] = {}
    for item in points:
        shown = item.plan or Plan.from_choices(base, item.predicted, item.predicted_outside)
        configs.setdefault("plan " + _label(shown.choices, shown.outside), plan_recipe(shown))
    memory.update(measure_recipes(model, batch, configs))
    timed = {**fixed, **{name: configs[name] for name in
                         ("plan " + _label(p.plan.choices, p.plan.outside) for p in points if p.plan is not None)}}
    steps = time_recipes(model, batch, timed, args.rounds)
    for item in points:
        shown = item.plan or Plan.from_choices(base, item.predicted, item.predicted_outside)
        name = "plan " + _label(shown.choices, shown.outside)
        item.measured_peak = memory[name][1]
        item.step = steps.get(name, float("nan"))

    print(header(args, work))
    print(f"no checkpointing: peak {none_peak / 2**20:.1f} MiB; profiling {profiling:.1f} s; planner choices "
          f"{','.join(choices)}; frontier of the plan at budget 1.0, each point planned with "
          f"acshim.plan(budget=point.budget, reuse=base) (verified, re-solved if measured over)")
    print(f"{'budget MiB':>10} {'budget x':>8} {'peak MiB':>8} {'peak x':>7} {'under':>5} {'step x':>7}  "
          f"{'predicted peak x, step x':>24}  choices (frontier's if different)")
    for item in points:
        shown = f"{item.budget / 2**20:>10.2f} {item.budget / none_peak:>8.2f} {item.measured_peak / 2**20:>8.2f} " \
                f"{item.measured_peak / none_peak:>7.2f}"
        if item.plan is None:
            print(f"{shown} {'NO':>5} {'':>7}  {'':>24}  no plan: {item.error} (frontier's "
                  f"{_label(item.predicted, item.predicted_outside)} measured as shown, not timed)")
            continue
        found = item.plan
        predicted = f"{found.peak / found.reference_peak:.2f}, {found.seconds / found.reference_seconds:.2f}"
        differs = "" if (found.choices, found.outside) == (item.predicted, item.predicted_outside) else (
            f" ({_label(item.predicted, item.predicted_outside)})")
        print(f"{shown} {'yes' if item.under else 'NO':>5} {item.step:>7.2f}  {predicted:>24}  "
              f"{_label(found.choices, found.outside)}{differs}")
    print("baselines:")
    for name in BASELINES:
        peak = memory[name][1]
        print(f"{'':>10} {'':>8} {peak / 2**20:>8.2f} {peak / none_peak:>7.2f} {'':>5} {steps[name]:>7.2f}  "
              f"{'':>24}  {name}")

    planned = [p for p in points if p.plan is not None]
    print(f"all {len(points)} points under budget: {'yes' if all(p.under for p in points) else 'NO'}"
          f" ({sum(p.under for p in points)} of {len(points)})")
    ordered = sorted(planned, key=lambda p: p.budget)
    pairs = [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:]]
    worst = max((b.step / a.step - 1 for a, b in pairs), default=0.0)
    breaks = [(a, b) for a, b in pairs if b.step > a.step * (1 + tol)]
    print(f"step time monotone in budget (a larger budget never more than {tol:.0%} slower, all pairs): "
          f"{'yes' if not breaks else 'NO'} (largest slowdown with a larger budget: {worst:+.1%})"
          + "".join(f"; {b.budget / none_peak:.2f}x at {b.step:.2f} vs {a.budget / none_peak:.2f}x at {a.step:.2f}"
                    for a, b in breaks))
    verdicts = []
    for name in BASELINES:
        peak, step = memory[name][1], steps[name]
        fitting = [p for p in planned if p.measured_peak <= peak]
        best = min(fitting, key=lambda p: (p.step, p.measured_peak), default=None)
        verdicts.append(best is not None and best.step <= step * (1 + tol))
        if best is None:
            low = min(planned, key=lambda p: (p.measured_peak, p.step), default=None)
            found = "NO: no plan point at or under its peak" + ("" if low is None else (
                f" (least-peak point: {low.measured_peak / 2**20:.2f} MiB, step {low.step:.2f})"))
        else:
            found = (f"{'yes' if verdicts[-1] else 'NO'}: fastest plan point at or under its peak: "
                     f"{best.budget / none_peak:.2f}x, peak {best.measured_peak / 2**20:.2f} MiB "
                     f"({best.measured_peak / none_peak:.2f}), step {best.step:.2f}")
        print(f"  {name:<20} peak {peak / 2**20:.2f} MiB ({peak / none_peak:.2f}), step {step:.2f}: {found}")
    print(f"frontier at or below every baseline point (peak <=, step <= within {tol:.0%}): "
          f"{'yes' if all(verdicts) else 'NO'} ({sum(verdicts)} of {len(verdicts)})")


def _label(choices: list[str], outside: str = "keep") -> str:
    """Short per-block choices, then the outside part's when it is not kept (``| out Od``)."""
    return " ".join(map(_short, choices)) + ("" if outside == "keep" else f" | out {_short(outside)}")


def _short(choice: str) -> str:
    return {"keep": "K", "selective": "S", "selective-alt": "S2", "recompute": "R", "offload:disk": "Od",
            "offload:host": "Oh", "recompute+offload:disk": "ROd", "recompute+offload:host": "ROh"}.get(choice, choice)


def main(argv: list[str]) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.compile:
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_planner_compile

        bench_planner_compile.run(args)
        return
    work = workload(args)
    if args.sweep:
        sweep(args, work)
    else:
        budgets_table(args, work)


if __name__ == "__main__":
    main(sys.argv[1:])

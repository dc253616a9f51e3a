"""Benchmark: the memory-budget planner (acshim.plan) beside every fixed recipe, acshim's and torch's.

Default mode, per model (``--model gpt2``: Hugging Face ``GPT2LMHeadModel`` 8 x 512, batch 2 x 256,
vocab 512, dropout on; ``--model llama``: ``LlamaForCausalLM`` of the same size, SwiGLU 1376, no
dropout; ``--model gpt``: acshim.testing.GPT of that shape; random weights, nothing downloaded):

- fixed recipes: no checkpointing; acshim's full recompute per block, every other block
  (``EveryNth(2)``), selective-op (save matmul/attention outputs) and disk offload alone around the
  step (prefetch 2); torch's ``checkpoint_wrapper`` per block and its selective checkpoint
  (``create_selective_checkpoint_contexts`` saving mm/addmm/bmm/sdpa). (torch's ``offload_wrapper``
  moves tensors to CPU memory: on a CPU it saves nothing and is left out.)
- plans at peak budgets 0.47 / 0.35 / 0.23 / 0.16 of no checkpointing's peak **by RSS**: bytes the
  process may hold above its baseline (``acshim.plan(model, batch, budget=bytes)``, each budget
  planned on its own, the first one's planning time in steps of no checkpointing), each in
  ``--plan-processes`` fresh processes (default 2): the table says whether they chose the same plan.
- peak by RSS of every configuration in a fresh process (benchmarks/memory_probe.py:
  ``MALLOC_MMAP_THRESHOLD_=65536``, a warm-up step, ``VmHWM`` above the baseline with gradients
  allocated); a plan is applied there from the JSON it was saved to.
- step time: all configurations in one process, interleaved, the order rotated each round; the
  median of per-round ratios to no checkpointing.
- checks, per budget: the plan's RSS peak within it (2%), and its step no slower than the fastest
  fixed recipe whose RSS peak fits the same budget, + 3%; and the plan's predictions against
  measurements: its activations' peak against that RSS peak, its whole step (with what the planning
  process held besides) against the step that verified it.

``--load both`` (default) runs it twice: idle, then with a busy-loop process on one core that the
benchmark starts and kills by pid (bounded by ``--busy-seconds`` in any case); ``idle`` / ``busy``
one of them. Output: paste-ready markdown tables.

``--sharded fsdp2|zero3``: the sharded row, ``acshim run --budget`` across 2 gloo ranks
(benchmarks/bench_sharded.py, which it runs).

``--sweep``: the 10 budgets of one plan's ``frontier()``, each planned with ``reuse=`` (no new
profiling), applied, measured (peak by the tracker) and timed beside the baselines; checks every
point within its budget, step time monotone in budget (``--tolerance``) and the frontier at or below
every baseline. ``--compile``: acshim plans under ``torch.compile`` beside torch's
``activation_memory_budget`` (benchmarks/bench_planner_compile.py).

    python benchmarks/bench_planner.py                      # HF GPT-2 8x512, idle then busy
    python benchmarks/bench_planner.py --model llama        # HF Llama 8x512
    python benchmarks/bench_planner.py --small --load idle  # quick check
    python benchmarks/bench_planner.py --small --sweep
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--model", choices=("gpt2", "llama", "gpt", "lora"), default="gpt2",
                        help="lora: fine-tuning, LoRA adapters (PEFT) on a frozen Llama with a big vocabulary "
                             "(defaults 4x128, seq 128, vocab 32000, budgets 0.5,0.35)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=0,
                        help="Llama's MLP width (default: 8/3 x width rounded up to a multiple of 32; 1376 at 512)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="timed rounds, each configuration one step per round (5 left identical models 3-4%% apart idle)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", default="0.47,0.35,0.23,0.16",
                        help="peak budgets as fractions of no checkpointing's peak by RSS")
    parser.add_argument("--load", choices=("both", "idle", "busy"), default="both",
                        help="idle, with a busy-loop process on one core (started and killed here), or both")
    parser.add_argument("--busy-seconds", type=int, default=3600,
                        help="the busy-loop process ends itself after this many seconds whatever happens")
    parser.add_argument("--plan-processes", type=int, default=2,
                        help="fresh processes each budget is planned in (the first one's plan is run); the table "
                             "says whether they all chose the same plan (default 2)")
    parser.add_argument("--tolerance-recipe", type=float, default=0.03,
                        help="a plan may be this much slower than the fastest fitting fixed recipe (default 0.03)")
    parser.add_argument("--small", action="store_true", help="4 layers, width 128, seq 64, vocab 512, 3 rounds")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="measure every point of one plan's frontier()")
    mode.add_argument("--compile", action="store_true",
                      help="under torch.compile, beside torch's activation_memory_budget")
    parser.add_argument("--sharded", choices=("fsdp2", "zero3"), default=None,
                        help="the sharded row: acshim run --budget on HF GPT-2 across 2 gloo ranks beside none and "
                             "full recompute on the same engine (runs benchmarks/bench_sharded.py)")
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

    if args.model == "gpt2":
        gpt2 = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=heads, n_positions=args.seq,
                                       vocab_size=args.vocab, bos_token_id=0, eos_token_id=1, use_cache=False)
        gpt2._attn_implementation = "sdpa"

        def build_gpt2() -> nn.Module:
            model = seeded(lambda: transformers.GPT2LMHeadModel(gpt2))
            model.train()
            return model

        return Workload(f"GPT-2 (HF GPT2LMHeadModel, transformers {transformers.__version__}) {shape}, dropout on",
                        build_gpt2, {"input_ids": ids, "labels": ids})

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
Config = Callable[[nn.Module], tuple[nn.Module, Scope]]  # a fresh model -> (model to run, scope around forward)


def fixed_configs(work: Workload) -> dict[str, Config]:
    """Every fixed recipe, each installed on a model of its own (torch's wrappers cannot be undone)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from acshim.blocks import find_blocks

    def torch_wrap(model: nn.Module, selective: bool) -> tuple[nn.Module, Scope]:
        blocks = {id(block) for _, block in find_blocks(model)}
        saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

        extra = {"context_fn": partial(create_selective_checkpoint_contexts, policy)} if selective else {}
        wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in blocks)
        return model, nullcontext

    def acshim_apply(model: nn.Module, **options: Any) -> tuple[nn.Module, Scope]:
        acshim.apply_checkpointing(model, **options)
        return model, nullcontext

    offload: Scope = lambda: acshim.offload(storage="disk", prefetch=2)  # noqa: E731
    return {
        "no checkpointing": lambda model: (model, nullcontext),
        "acshim full recompute": acshim_apply,
        "acshim every 2nd block": lambda model: acshim_apply(model, policy=acshim.EveryNth(2)),
        "acshim selective-op": lambda model: acshim_apply(model, context_fn=save_ops()),
        "acshim disk offload alone": lambda model: (model, offload),
        "torch checkpoint_wrapper": lambda model: torch_wrap(model, False),
        "torch selective (SAC)": lambda model: torch_wrap(model, True),
    }


def plan_config(path: str) -> Config:
    def install(model: nn.Module) -> tuple[nn.Module, Scope]:
        Plan.load(path).apply(model)
        return model, nullcontext
    return install


def _args_json(args: argparse.Namespace) -> str:
    import json

    return json.dumps({k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})


def _args_from(text: str) -> argparse.Namespace:
    import json

    return argparse.Namespace(**json.loads(text))


def _child(kind: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Run ``kind`` (``rss`` or ``plan``) in a fresh interpreter with freed memory returned at once
    (``MALLOC_MMAP_THRESHOLD_=65536``, docs/measuring.md); its JSON result."""
    import json
    import os
    import subprocess

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run([sys.executable, __file__, "--child", kind, _args_json(args), *extra], env=env,
                          capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[len("CHILD "):])
    raise RuntimeError(f"bench child {kind} {extra} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def child_main(kind: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """``rss CONFIG [PLAN.json]``: the configuration's peak above a baseline with gradients
    allocated, after two warm-up steps. ``plan BYTES PLAN.json``: plan at that budget (bytes above
    what the process holds when planning starts), save it, and time planning against a step of no
    checkpointing (the planner's one-time imports done first, as ``acshim run`` does at start)."""
    torch.set_num_threads(args.threads)
    work = workload(args)
    model = work.build()
    if kind == "plan":
        from acshim.planner.warmup import warm_up

        budget, path = int(extra[0]), extra[1]
        step = make_step(model, work.batch)
        step()
        none = min(_timed_once(step) for _ in range(3))
        warm_up(planner_choices(args))
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        try:
            found = acshim.plan(model, work.batch, budget=budget, choices=planner_choices(args))
        except ValueError as error:
            return {"error": str(error).splitlines()[0][:300]}
        seconds = time.perf_counter() - start
        found.save(path)
        return {"planning_seconds": seconds, "none_seconds": none, "choices": found.choices, "outside": found.outside,
                "predicted_peak": found.peak, "predicted_whole": found.peak + found.overhead,
                "measured_process_peak": found.measured_process_peak}
    config = plan_config(extra[1]) if extra[0] == "plan" else fixed_configs(work)[extra[0]]
    model, scope = config(model)
    step = make_step(model, work.batch, scope)
    step()
    step()
    model.zero_grad(set_to_none=False)  # the baseline has the gradients allocated
    _reset_hwm()
    base = _rss()
    with scope():
        loss = forward_loss(model, work.batch)
    loss.backward()
    return {"peak": _hwm() - base}


def _timed_once(step: Step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def budgets_table(args: argparse.Namespace, work: Workload) -> None:
    import subprocess
    import tempfile

    loads = ["idle", "busy"] if args.load == "both" else [args.load]
    fractions = [float(f) for f in args.budgets.split(",")]
    print(f"### {work.label}\n\n{header(args, work)}; peaks by RSS in fresh processes (MALLOC_MMAP_THRESHOLD_=65536), "
          "above a baseline with gradients allocated; step time: median of per-round ratios to no checkpointing, all "
          "configurations interleaved in one process; shared machine.\n")
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as directory:
        for load in loads:
            busy = None
            if load == "busy":  # one core kept busy by another process, ended by its pid (and its own clock)
                busy = subprocess.Popen([sys.executable, "-c", f"import time\nt = time.time()\n"
                                         f"while time.time() - t < {args.busy_seconds}: pass"])
            try:
                _one_load(args, work, load, fractions, directory)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait(timeout=30)


def _one_load(args: argparse.Namespace, work: Workload, load: str, fractions: list[float], directory: str) -> None:
    import os

    fixed = fixed_configs(work)
    peaks = {name: _child("rss", args, [name])["peak"] for name in fixed}
    none_peak = peaks["no checkpointing"]
    plans: dict[float, dict[str, Any]] = {}
    for fraction in fractions:
        path = os.path.join(directory, f"plan-{load}-{fraction}.json")
        found = _child("plan", args, [str(int(fraction * none_peak)), path])
        found["path"] = path
        # the same budget planned again in other fresh processes: do they choose the same plan?
        again = [_child("plan", args, [str(int(fraction * none_peak)), f"{path}.again{i}"])
                 for i in range(1, args.plan_processes)]
        found["same"] = [_label(other["choices"], other["outside"]) if "error" not in other else "refused"
                         for other in again]
        if "error" not in found:
            found["peak"] = _child("rss", args, ["plan", path])["peak"]
        plans[fraction] = found
    configs: dict[str, Config] = dict(fixed)
    for fraction, found in plans.items():
        if "error" not in found:
            configs[f"plan @ {fraction:.2f}"] = plan_config(found["path"])
    models = {name: config(work.build()) for name, config in configs.items()}

    def prepare(name: str) -> Step:
        model, scope = models[name]
        return make_step(model, work.batch, scope)

    for name in configs:  # lazy initialisation out of the timed rounds
        prepare(name)()
    ratios = interleaved(list(configs), prepare, args.rounds, reference="no checkpointing")
    steps = {name: statistics.median(values) for name, values in ratios.items()}
    models.clear()

    print(f"#### {load}: {'a busy-loop process on one core' if load == 'busy' else 'no other work started'}\n")
    print("| configuration | peak × none (RSS) | step × none |")
    print("|---|---|---|")
    for name in fixed:
        print(f"| {name} | {peaks[name] / none_peak:.2f} | {steps[name]:.2f} |")
    print(f"\nno checkpointing: peak {none_peak / 2**20:.1f} MiB above the baseline\n")
    print("| budget × none | plan (blocks; outside) | peak × none (RSS) | within budget | step × none "
          "| fastest fixed recipe within the budget (step ×) | plan ≤ it + 3% | planning (steps of none) "
          "| predicted / measured (MiB): peak in its own process; whole step verified "
          f"| same plan in {args.plan_processes} processes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fraction, found in plans.items():
        budget = fraction * none_peak
        fitting = [name for name in fixed if peaks[name] <= budget * 1.02]
        best = min(fitting, key=lambda name: steps[name], default=None)
        recipe = f"{best} ({steps[best]:.2f})" if best else "none fits"
        if "error" in found:
            same = "yes" if all(other == "refused" for other in found["same"]) else f"NO: {', '.join(found['same'])}"
            print(f"| {fraction:.2f} | refused: {found['error'][:120]} | | | | {recipe} | | | | {same} |")
            continue
        name = f"plan @ {fraction:.2f}"
        within = "yes" if found["peak"] <= budget * 1.02 else "NO"
        faster = "" if best is None else ("yes" if steps[name] <= steps[best] * (1 + args.tolerance_recipe) else "NO")
        print(f"| {fraction:.2f} | {_label(found['choices'], found['outside'])} | {found['peak'] / none_peak:.2f} "
              f"| {within} | {steps[name]:.2f} | {recipe} | {faster} "
              f"| {found['planning_seconds'] / found['none_seconds']:.1f} "
              f"| {_predicted_measured(found)} | {_same(found)} |")
    print("\nPlans per block: K keep, S selective, S2 every other matmul, R full recompute, Od offload to disk, "
          "ROd recompute with the input offloaded; `+ out Od`: the part outside the blocks offloaded.\n")


def _same(found: dict[str, Any]) -> str:
    """Whether the other processes planning the same budget chose this plan ("NO: theirs" if not)."""
    mine = _label(found["choices"], found["outside"])
    return "yes" if all(other == mine for other in found["same"]) else f"NO: {', '.join(found['same'])}"


def _predicted_measured(found: dict[str, Any]) -> str:
    """The plan's predictions against measurements, with their ratios: its activations' peak against
    the peak its own fresh process measured by RSS after two warm-up steps (neither the planning
    process's other memory nor code paged in there), and its whole step (with what the planning
    process held besides, code paged in charged) against the step that verified it there."""
    def pair(predicted: int, measured: int | None) -> str:
        if not measured:
            return f"{predicted / 2**20:.1f} / -"
        return f"{predicted / 2**20:.1f} / {measured / 2**20:.1f} ({predicted / measured:.2f}x)"
    return f"{pair(found['predicted_peak'], found['peak'])}; {pair(found['predicted_whole'], found['measured_process_peak'])}"


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
    """Short per-block choices, then the outside part's when it is not kept (``+ out Od``; no ``|``, which would split a table cell)."""
    return " ".join(map(_short, choices)) + ("" if outside == "keep" else f" + out {_short(outside)}")


def _short(choice: str) -> str:
    return {"keep": "K", "selective": "S", "selective-alt": "S2", "recompute": "R", "offload:disk": "Od",
            "offload:host": "Oh", "recompute+offload:disk": "ROd", "recompute+offload:host": "ROh"}.get(choice, choice)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--child":
        import json

        print("CHILD " + json.dumps(child_main(argv[1], _args_from(argv[2]), argv[3:])), flush=True)
        return
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.sharded:  # ranks are processes: benchmarks/bench_sharded.py runs each configuration under torchrun
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_sharded

        bench_sharded.main(["--engine", args.sharded, "--load", args.load])
        return
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

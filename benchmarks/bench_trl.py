"""Benchmark: TRL's own SFT script (``trl/scripts/sft.py``, unchanged) under ``acshim run --budget``
beside the fixed recipes a TRL user can choose from its command line (issue 26 item 5).

The scenario of tests/hf/test_finetuning_budget.py: ``acshim.testing.write_finetuning_fixture`` (a
6 x 128 ``LlamaForCausalLM``, vocabulary 512, random weights, jsonl data of 48 rows, nothing
downloaded), batch 8, sequences up to 121 tokens, full fine-tuning, AdamW, ``--steps`` steps. Every
configuration is a fresh process of the script as a user runs it (no ``MALLOC_*`` or thread
variable set), through benchmarks/trainer_probe.py:

- ``none``: ``--gradient_checkpointing False``;
- ``torch recompute``: ``--gradient_checkpointing True`` (Hugging Face's checkpoint call: torch's);
- ``acshim recompute``: the same under ``acshim run``; and again with ``MALLOC_MMAP_THRESHOLD_=65536``,
  the allocator setting ``acshim run --budget`` makes for itself (``acshim/allocator.py``: the
  process's memory then follows what tensors hold), so that its cost is seen apart from the plan's;
- ``disk offload``: ``--activation_offloading True`` (TRL's activation offloading, served by
  ``acshim.offload`` under ``acshim run``, ``ACSHIM_OFFLOAD_STORAGE=disk``: host memory saves
  nothing on a CPU), no recompute;
- ``recompute + disk offload``: both flags;
- ``plan B``: ``acshim run --budget B`` with ``--gradient_checkpointing True`` (the script's own
  checkpoint calls follow the plan); where B is refused, the budget the refusal names, as its user
  would run next (said in the table). ``--without-cache`` adds each plan with ``ACSHIM_HOST_CACHE=0``
  (acshim's CPU tensor allocator off: a mapping per tensor, as the mmap threshold alone gives), as
  reference rows the checks below do not apply to.

Peak: ``VmHWM`` above what the process held when its first training step started (planning
counted). Step time: the median of the steps from the third on (the time between two steps'
starts, optimizer included), as a ratio to ``none``'s in the same round; rounds interleave every
configuration, the order rotated each round, and the table gives each ratio's median over rounds.
Planning: the plan's first two steps beyond two of its steady steps, in steps of ``none``. ``--load
both`` (default) runs idle, then with a busy-loop process on one core (started and killed here).
Checks, per budget: the plan's peak within its budget (2%: pages), and its step no slower than the
fastest fixed recipe whose peak fits the same budget, + 3%.

    python benchmarks/bench_trl.py                          # 0.5, idle then busy, 3 rounds
    python benchmarks/bench_trl.py --budgets 0.5,0.3 --rounds 5 --load idle
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "trainer_probe.py"
MiB = 1 << 20


@dataclass
class Config:
    """One way of running the script: acshim run or not, its flags, its environment."""

    name: str
    acshim: list[str] | None
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def planned(self) -> bool:
        return bool(self.acshim and "--budget" in self.acshim)

    @property
    def checked(self) -> bool:
        """A plan the checks hold to its budget and speed (not ``--without-cache``'s reference rows)."""
        return self.planned and "ACSHIM_HOST_CACHE" not in self.env


def configs(budgets: list[str], without_cache: bool = False) -> list[Config]:
    def flags(recompute: bool, offload: bool = False) -> list[str]:
        return ["--gradient_checkpointing", str(recompute), *(["--activation_offloading", "True"] if offload else [])]

    disk = {"ACSHIM_OFFLOAD_STORAGE": "disk"}
    fixed = [Config("none", None, flags(False)), Config("torch recompute", None, flags(True)),
             Config("acshim recompute", [], flags(True)),
             Config("acshim recompute, 64 KiB mmap threshold", [], flags(True), {"MALLOC_MMAP_THRESHOLD_": "65536"}),
             Config("disk offload", [], flags(False, True), disk),
             Config("recompute + disk offload", [], flags(True, True), disk)]
    planned = [Config(f"plan {budget}", ["--budget", budget], flags(True)) for budget in budgets]
    if without_cache:  # the same plan with a mapping per tensor, as before acshim's allocator cached
        planned += [Config(f"plan {budget}, ACSHIM_HOST_CACHE=0", ["--budget", budget], flags(True),
                           {"ACSHIM_HOST_CACHE": "0"}) for budget in budgets]
    return fixed + planned


def run(config: Config, directory: Path, steps: int, output: str, retry: bool = True) -> dict:
    """One fresh process of TRL's SFT script as ``config``; what the probe printed (a refused
    budget: once more at the budget the refusal names, ``retry``)."""
    import trl.scripts.sft

    script = Path(trl.scripts.sft.__file__)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(directory / "datasets"), TOKENIZERS_PARALLELISM="false",
               **config.env)
    args = [str(PROBE), str(script), "--model_name_or_path", str(directory / "model"), "--dataset_name",
            str(directory / "data"), "--output_dir", str(directory / output), *config.flags, "--max_steps",
            str(steps), "--per_device_train_batch_size", "8", "--report_to", "none", "--seed", "3",
            "--save_strategy", "no", "--max_length", "121", "--dataloader_num_workers", "0", "--bf16", "False",
            "--use_cpu", "True", "--disable_tqdm", "True"]
    command = [sys.executable, *(["-m", "acshim", "run", *config.acshim] if config.acshim is not None else []), *args]
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=900)
    named = re.search(r"pass --budget (\S+) or more", done.stderr) if done.returncode == 2 else None
    if named and config.planned and retry:  # refused: the budget it names, as its user would run next
        again = Config(config.name, ["--budget", named.group(1)], config.flags, config.env)
        return {**run(again, directory, steps, output, retry=False), "named": named.group(1)}
    if done.returncode != 0:
        raise RuntimeError(f"{config.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")][-1]
    found = json.loads(line[len("PROBE "):])
    starts = found["starts"]
    durations = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    found["step"] = statistics.median(durations[2:])
    found["first_two"] = sum(durations[:2])
    return found


def bench(directory: Path, budgets: list[str], rounds: int, steps: int, load: str,
          without_cache: bool = False) -> list[str]:
    """Every configuration ``rounds`` times, interleaved; the markdown table and the checks' lines."""
    chosen = configs(budgets, without_cache)
    results: dict[str, list[dict]] = {config.name: [] for config in chosen}
    for round_index in range(rounds):
        order = chosen[round_index % len(chosen):] + chosen[:round_index % len(chosen)]
        for config in order:
            results[config.name].append(run(config, directory, steps, f"out-{round_index}"))
            print(f"  {load} round {round_index + 1}/{rounds}: {config.name}", file=sys.stderr, flush=True)
    none = results["none"]

    def ratio(name: str) -> float:  # the median over rounds of each round's step ratio to none's
        return statistics.median(r["step"] / n["step"] for r, n in zip(results[name], none, strict=True))

    def peak(name: str) -> float:
        return max(r["peak"] for r in results[name])

    lines = [f"#### {load}: {'a busy-loop process on one core' if load == 'busy' else 'no other work started'}",
             "", f"none: peak {peak('none') / MiB:.1f} MiB, step {statistics.median(r['step'] for r in none):.3f} s",
             "", "| configuration | plan | peak (MiB) | peak × none | step × none | budget (MiB) | fastest fixed "
             "recipe that fits | planning (steps of none) |", "|---|---|---|---|---|---|---|---|"]
    fixed = [config.name for config in chosen if not config.planned]
    checks = []
    for config in chosen:
        rows = results[config.name]
        budget = rows[0]["budget"] if config.planned else None
        plans = sorted({row["plan"] for row in rows if row["plan"]})
        named = sorted({row["named"] for row in rows if "named" in row})
        if named:
            plans = [f"refused, naming {' / '.join(named)}: planned there:", *plans]
        fits = ""
        planning = ""
        if budget:
            fitting = [name for name in fixed if peak(name) <= budget]
            best = min(fitting, key=ratio) if fitting else None
            fits = f"{best} {ratio(best):.2f}" if best else "none fits"
            planning = f"{statistics.median((r['first_two'] - 2 * r['step']) / n['step'] for r, n in zip(rows, none, strict=True)):.1f}"
            within = peak(config.name) <= budget * 1.02
            faster = best is None or ratio(config.name) <= ratio(best) * 1.03
            if config.checked:
                checks.append(f"{config.name} ({load}): peak {peak(config.name) / budget:.3f} of the budget "
                              f"({'within' if within else 'OVER'}); step {ratio(config.name):.3f} × none against "
                              f"{fits or 'no fixed recipe that fits'} ({'ok' if faster else 'SLOWER than +3%'}); "
                              f"plans: {' / '.join(plans) or '-'}")
            else:  # a reference row: its figures, not held to the checks
                checks.append(f"{config.name} ({load}, reference): peak {peak(config.name) / budget:.3f} of the "
                              f"budget; step {ratio(config.name):.3f} × none against {fits or 'no fixed recipe that fits'}")
        lines.append(f"| {config.name} | {' / '.join(plans) or '-'} | {peak(config.name) / MiB:.1f} | "
                     f"{peak(config.name) / peak('none'):.2f} | {ratio(config.name):.2f} | "
                     f"{f'{budget / MiB:.1f}' if budget else '-'} | {fits or '-'} | {planning or '-'} |")
    return lines + ["", *checks, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="0.5", help="comma-separated budgets for acshim run --budget")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every configuration")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the steady ones from the third)")
    parser.add_argument("--load", choices=("both", "idle", "busy"), default="both",
                        help="idle, with a busy-loop process on one core (started and killed here), or both")
    parser.add_argument("--without-cache", action="store_true",
                        help="also run each plan with ACSHIM_HOST_CACHE=0 (a mapping per tensor, acshim's allocator off)")
    parser.add_argument("--busy-seconds", type=int, default=3600,
                        help="the busy-loop process ends itself after this many seconds whatever happens")
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: pip install 'acshim[finetune]'")
    from acshim.testing import write_finetuning_fixture

    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="acshim-bench-trl-") as name:
        directory = Path(name)
        write_finetuning_fixture(str(directory), vocab=512, hidden=128, layers=6, rows=48, words=120)
        for load in (["idle", "busy"] if args.load == "both" else [args.load]):
            busy = None
            if load == "busy":  # one core kept busy by another process, ended by its pid (and its own clock)
                busy = subprocess.Popen([sys.executable, "-c", f"import time\nt = time.time()\n"
                                         f"while time.time() - t < {args.busy_seconds}: pass"])
            began = time.time()
            try:
                out += bench(directory, args.budgets.split(","), args.rounds, args.steps, load, args.without_cache)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait(timeout=30)
            print(f"  {load}: {time.time() - began:.0f} s", file=sys.stderr, flush=True)
    print("\n".join(out))
    return 1 if any("OVER" in line or "SLOWER" in line for line in out) else 0


if __name__ == "__main__":
    sys.exit(main())

"""A memory budget is a promise about the process's memory (issue 17, issue 18 items 2 and 3): under
``acshim run --budget`` the resident high-water mark above a baseline taken with parameters and
gradients allocated stays within the budget on every step, the planning step included, measured as
docs/measuring.md says (fresh process, ``MALLOC_MMAP_THRESHOLD_=65536``, ``VmHWM`` reset each step
through ``/proc/self/clear_refs``). Subprocesses: the patches, the router and the high-water mark
are process-wide."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MEMORY_FUNCTIONS = (Path(__file__).parent / "vmhwm_functions.py").read_text()
"""rss(), hwm() and reset(), pasted into the probe scripts."""

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

PROBE = """
import ctypes, json, os, sys, time, torch
torch.set_num_threads(1)
""" + MEMORY_FUNCTIONS + """
def budget():
    import acshim.region
    routers = acshim.region.ROUTERS
    return routers[0].plan.budget if routers and routers[0].plan is not None else None
"""

HF_LOOP = PROBE + """
import transformers
layers, width, batch = (int(n) for n in sys.argv[1].split("x"))
config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=256, vocab_size=512,
                                 bos_token_id=0, eos_token_id=1)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config)
model.train()
lengths = [int(n) for n in sys.argv[2].split(",")]
batches = [torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
model(input_ids=batches[-1], labels=batches[-1]).loss.backward()  # lazy initialisation (one step, no regions)
model.zero_grad(set_to_none=False)                                # gradients stay allocated
model.gradient_checkpointing_enable()
reset()
base = rss()
peaks = []
for ids in batches:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss
    with torch.no_grad():                                         # evaluation: no backward, no plan
        model(input_ids=ids)
    peaks.append(hwm() - base)
    reset()
print("RESULT " + json.dumps({"peaks": peaks, "budget": budget()}))
"""


PEFT_LIKE = PROBE + """
import transformers
""" + 'class LoRA(torch.nn.Module):\n    def __init__(self, base, rank=8):\n        super().__init__()\n        self.base = base\n        self.a = torch.nn.Linear(base.in_features, rank, bias=False)\n        self.b = torch.nn.Linear(rank, base.out_features, bias=False)\n        torch.nn.init.zeros_(self.b.weight)\n    def forward(self, x):\n        return self.base(x) + self.b(self.a(x))\n\nconfig = transformers.LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,\n                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)\ntorch.manual_seed(0)\nmodel = transformers.LlamaForCausalLM(config)\nfor p in model.parameters():\n    p.requires_grad_(False)\nfor layer in model.model.layers:\n    layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)\n    layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)\nmodel.enable_input_require_grads()\nmodel.train()\nids = torch.randint(0, 32000, (4, 256), generator=torch.Generator().manual_seed(1))\nmodel(input_ids=ids, labels=ids).loss.backward()                  # warm-up, gradients allocated\nmodel.zero_grad(set_to_none=False)\nmodel.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})\n\n' + """
""" + 'reset()\nbase = rss()\npeaks = []\nfor step in range(3):\n    model(input_ids=ids, labels=ids).loss.backward()\n    peaks.append(hwm() - base)\n    reset()\nprint("RESULT " + json.dumps({"peaks": peaks, "budget": budget()}))\n'
"""Issue 18's fine-tuning shape: LoRA adapters on a frozen tiny Llama with a 32k vocabulary (what
dominates is outside the blocks: the logits and the loss over the vocabulary), HF gradient
checkpointing with use_reentrant=True as PEFT's examples/sft/train.py sets it."""


def _run(tmp_path: Path, script: str, *args: str, budget: str, extra: tuple[str, ...] = (), verb: str = "run",
         malloc_variable: bool = True) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update({"MALLOC_MMAP_THRESHOLD_": "65536"} if malloc_variable else {}, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "acshim", verb, "--budget", budget, *extra, *(["--"] * (verb == "plan")),
                           str(path), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_whole_run_high_water_mark_within_budget_planning_step_included(tmp_path: Path) -> None:
    """Issue 17's scenario: a plain Hugging Face loop (GPT-2 8x384, batch 2x256,
    gradient_checkpointing_enable, 4 steps): the resident high-water mark of every step above the
    baseline (parameters and gradients allocated) is within the budget, the step the plan is made in
    first. (Before this change: 150 MB above the baseline at a budget of 83.6 MiB, 1.7x, the planning
    step the peak.) At 0.5 here, with no MALLOC_* variable; 0.3 is the next test's."""
    result = _result(_run(tmp_path, HF_LOOP, "8x384x2", "256,256,256,256", budget="0.5", malloc_variable=False))
    limit = result["budget"] * 1.02
    assert all(peak <= limit for peak in result["peaks"]), (result, [p / limit for p in result["peaks"]])


def test_whole_run_within_budget_with_no_malloc_variable(tmp_path: Path) -> None:
    """Issue 26 item 1: the same loop at --budget 0.3 in the environment a user has (no MALLOC_*
    variable) was refused ("predictions were low by up to 10.9 MiB"); ``acshim run`` now fixes the
    process's mmap threshold itself before torch is imported (``acshim.allocator``): it plans, and
    every step, the planning step first, is within the budget, with acshim's CPU allocator caching
    freed blocks for the planned steps (``acshim.host_allocator``)."""
    loop = HF_LOOP.replace('"budget": budget()}', '"budget": budget(), '
                           '"allocator": __import__("acshim.allocator").allocator.how_set(), '
                           '"cache": __import__("acshim.host_allocator").host_allocator.stats()}')
    result = _result(_run(tmp_path, loop, "8x384x2", "256,256,256,256", budget="0.3", malloc_variable=False))
    assert result["allocator"] == "mallopt" and result["budget"] is not None, result
    # the planned steps' tensors came from acshim's allocator, freed blocks served again
    assert result["cache"]["hits"] > 0, result
    limit = result["budget"] * 1.02
    assert all(peak <= limit for peak in result["peaks"]), (result, [peak / limit for peak in result["peaks"]])


def test_dynamic_padding_every_step_within_budget_and_no_warning_for_evaluation(tmp_path: Path) -> None:
    """Issue 18 item 3: five steps of growing sequence length (dynamic padding): each step larger
    than any planned for is planned again before it runs, within the budget's bytes (the first
    plan's); every step's high-water mark stays within them; the evaluation forwards (no backward)
    between steps are neither planned nor warned about."""
    done = _run(tmp_path, HF_LOOP, "4x256x4", "96,112,128,144,160", budget="0.9")  # bytes: the first step's plan
    result = _result(done)
    limit = result["budget"] * 1.02
    assert all(peak <= limit for peak in result["peaks"]), (result, [p / limit for p in result["peaks"]])
    assert len(re.findall(r"are larger than those planned for .*: planned again", done.stderr)) == 4, done.stderr
    assert "may exceed" not in done.stderr and "inputs hold" not in done.stderr


def _suggestion(stderr: str) -> str:
    found = re.search(r"pass --budget (\S+) or more", stderr)
    assert found, stderr[-3000:]
    return found.group(1)


def test_budget_below_what_one_forward_needs_names_where_and_its_suggestion_plans(tmp_path: Path) -> None:
    """Issue 18 item 2, PEFT-shaped: at --budget 0.3 one forward of the model cannot fit (the LM
    head's logits over 32k tokens): refused with exit 2 before anything went over, naming the part
    and the operator with its bytes; the suggested budget then plans, and every step is within it."""
    refused = _run(tmp_path, PEFT_LIKE, budget="0.3")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "one forward of the model, keeping nothing for backward, needs more than the budget 0.3" in refused.stderr
    assert "in the part outside the blocks (embeddings, head, loss) (aten.mm.default would have made 125.0 MiB" \
        in refused.stderr, refused.stderr[-3000:]
    suggested = _suggestion(refused.stderr)
    result = _result(_run(tmp_path, PEFT_LIKE, budget=suggested))
    assert all(peak <= result["budget"] * 1.02 for peak in result["peaks"]), result


def test_budget_below_the_least_peak_names_what_dominates_and_its_suggestion_plans(tmp_path: Path) -> None:
    """Issue 18 item 2: a budget below the least achievable peak is refused naming the parts of that
    peak with their bytes, largest first; the budget it suggests plans (before this change the
    suggestion failed: 'no plan measured within the budget 45.3 MiB')."""
    refused = _run(tmp_path, HF_LOOP, "8x384x2", "256,256", budget="26MiB")
    assert refused.returncode == 2, refused.stderr[-3000:]
    # below the least peak (its parts named), or a block whose every choice went over while measured
    # (which one, and how far it got): which it is depends on how far copies in flight had got
    parts = re.search(r"is below the least achievable peak activation memory, [\d.]+ MiB .* of that peak (.*); pass",
                      refused.stderr)
    stopped = re.search(r"too small to measure any way of running block \S+ within it: the least its measurements "
                        r"needed was over [\d.]+ MiB", refused.stderr)
    assert (parts and re.search(r"is [\d.]+ MiB", parts.group(1))) or stopped, refused.stderr[-3000:]
    suggested = _suggestion(refused.stderr)
    assert "the least peak the planner predicts" in refused.stderr, refused.stderr[-3000:]  # the frontier's
    # At the budget named it plans, idle or loaded. (A stopped measurement's graph, held by its frames
    # into the next measurement, once made a loaded run refuse the named budget again: measuring a
    # block's disk offload started with the stopped recompute's 35 MiB still held.)
    done = _run(tmp_path, HF_LOOP, "8x384x2", "256,256", budget=suggested)
    result = _result(done)
    # At the frontier's least budget, the planning step's measurements of choices the least plan does
    # not use are stopped at the guard (5% below a budget this size), and what the guard cannot see
    # before it is there (other threads' allocations, Python's object arenas) took them up to 3.1 MiB
    # past it under load; with a 1% guard, and a stopped measurement's graph held on by its frames
    # into the next measurement (``process.release_stopped``), the planning step peaked 5.2% and
    # 6.2% over this budget in the clean-clone CI. Every step within 2%, the planning step included.
    assert all(peak <= result["budget"] * 1.02 for peak in result["peaks"]), result


@pytest.mark.exclusive  # "idle" must be idle: another xdist worker's tests are a second, uncontrolled load
def test_the_same_plan_idle_and_with_a_core_kept_busy(tmp_path: Path) -> None:
    """Issue 17 item 2: the same model, batch and budget give the same plan in two processes, the
    second with another process keeping a core busy throughout (started and killed here, by pid).
    Run alone (``exclusive``): beside another worker's tests, the first ran on a busy machine and the
    second beside two loads, and under two loads disk offload and recompute are estimated within
    0.1-5 ms of each other on this model (5 recompute chosen in 3 processes of 3 here, offload in a
    CI run's busy process).
    (Before: '6 offload:disk' under load against '5 recompute+offload:disk, 1 keep', 0.15x against
    0.29x of no checkpointing; then, with the least peak among plans within 3% of the fastest, plans
    at that band's edge that differed in one block.)"""
    plans = []
    for busy in (False, True):
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            done = _run(tmp_path, HF_LOOP, "8x384x2", "256", budget="0.3", extra=("--plan-file", f"plan{busy}.json"),
                        verb="plan")
        finally:
            if loop is not None:
                loop.kill()
                loop.wait(timeout=30)
        assert done.returncode == 0, done.stderr[-3000:]
        saved = json.loads((tmp_path / f"plan{busy}.json").read_text())
        plans.append((saved["choices"], saved["outside"]))
    assert plans[0] == plans[1], plans

"""``acshim run --budget``, ``acshim plan`` and ``acshim run --report`` on unchanged scripts (subprocess:
the patches and the plan router are process-wide)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from acshim.planner.solver import NOISE

MODEL = """
import json, os, sys, torch
import acshim
from acshim.testing import GPT, GPTBlock, seeded, train_step
W, S, B = (int(os.environ.get(k, d)) for k, d in (("TEST_WIDTH", 64), ("TEST_SEQ", 32), ("TEST_BATCH", 2)))
def build():
    return seeded(lambda: GPT(layers=4, width=W, heads=4, seq=S, vocab=128))
ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(3))
"""
PLANNABLE = {"TEST_WIDTH": "256", "TEST_SEQ": "128", "TEST_BATCH": "4", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""Sizes whose activations (about 60 MB without checkpointing) the process's memory resolves to 2%
(a --budget run is measured as the process sees it: the 4x64 model holds less than the 1 MiB that
interpreter bookkeeping moves), with freed tensors given back at once as docs/measuring.md says
(with glibc's default settings they stay in its heap and the resident set runs ahead of them)."""

CHECKPOINT_WRAPPER = MODEL + """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
reference = train_step(build(), ids, seed=7)          # no checkpointing: no region, nothing planned
model = build()
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPTBlock))
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    got = train_step(model, ids, seed=7)
    print("trained step", step, flush=True)
got = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in got.items()}  # torch's wrapper prefix
equal = set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
routers = acshim.region.ROUTERS
result = {"equal": equal}
if routers:
    from acshim.planner import measure_step
    result["peak"] = measure_step(model, ids)[1]
    result["budget"] = routers[0].plan.budget
print("RESULT " + json.dumps(result))
"""


def _acshim(*args: str, cwd: Path, timeout: int = 900, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "acshim", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _script(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _result(stdout: str) -> dict:
    line = [line for line in stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def planned_with_plan_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``acshim run --budget 0.7 --plan-file plan.json`` on CHECKPOINT_WRAPPER (2 steps), launched once
    for the two tests that check it: the run's plan and gradients, and the plan file it writes (which
    the plan-file test then reuses and refuses); its folder (script, plan.json) and the run."""
    folder = tmp_path_factory.mktemp("plan-file")
    script = _script(folder, CHECKPOINT_WRAPPER)
    return folder, _acshim("run", "--budget", "0.7", "--plan-file", "plan.json", str(script), "2", cwd=folder,
                           env=PLANNABLE)


def test_run_budget_replaces_checkpoint_wrapper_recipe_gradients_bitwise_peak_within(
        planned_with_plan_file: tuple[Path, subprocess.CompletedProcess]) -> None:
    """The run (saving its plan too: the plan-file test's first run, launched once for both)."""
    done = planned_with_plan_file[1]
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "replaced" in line]
    assert len(lines) == 1, done.stderr  # one log line
    assert "replaced 4 region(s) (4 torch checkpoint_wrapper: recompute) by the plan" in lines[0]
    result = _result(done.stdout)
    assert result["equal"], result  # dropout on, same seed: bitwise equal to no checkpointing
    assert result["peak"] <= result["budget"], result


TORCH_UTILS_CHECKPOINT = MODEL + """
import warnings
import torch.utils.checkpoint
from torch.utils.checkpoint import checkpoint
from acshim.testing import GPT

WARNED_AT = []

class Checkpointed(GPT):                                 # the script calls torch's checkpoint itself
    def forward(self, ids):
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))
        x = checkpoint(self.h[0], x, use_reentrant=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = checkpoint(self.h[1], x)                 # torch warns and means use_reentrant=True
        assert [str(w.message)[:63] for w in caught] == [
            "torch.utils.checkpoint: the use_reentrant parameter should be p"], caught
        WARNED_AT.append(caught[0].filename)
        x = torch.utils.checkpoint.checkpoint_sequential(self.h[2:], 2, x, use_reentrant=False)  # h.3 not checkpointed
        logits = self.ln_f(x) @ self.wte.weight.t()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

reference = train_step(seeded(lambda: GPT(layers=4, width=W, heads=4, seq=S, vocab=128)), ids, seed=7)
model = seeded(lambda: Checkpointed(layers=4, width=W, heads=4, seq=S, vocab=128))
for step in range(2):
    got = train_step(model, ids, seed=7)
equal = set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
routers = acshim.region.ROUTERS
result = {"equal": equal, "routed": torch.utils.checkpoint.checkpoint.__code__.co_filename.endswith("torch_route.py"),
          "warned_here": WARNED_AT[-1] == __file__}
if routers:
    from acshim.planner import measure_step
    result["peak"] = measure_step(model, ids)[1]
    result["budget"] = routers[0].plan.budget
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("flag", ["--budget", "--report"])
def test_torch_utils_checkpoint_calls_are_planned_and_reported(tmp_path: Path, flag: str) -> None:
    """The script's own ``torch.utils.checkpoint`` calls (both modes, the default, ``checkpoint_sequential``)
    become regions the plan replaces and the report counts; weights bitwise equal to no checkpointing."""
    script = _script(tmp_path, TORCH_UTILS_CHECKPOINT)
    env = PLANNABLE if flag == "--budget" else {}
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env})
    assert plain.returncode == 0, plain.stderr
    assert _result(plain.stdout)["equal"] and not _result(plain.stdout)["routed"]
    done = _acshim("run", *([flag, "0.7"] if flag == "--budget" else [flag]), str(script), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    result = _result(done.stdout)
    assert result["equal"], result
    assert result["routed"]  # torch.utils.checkpoint.checkpoint goes to the engine while the script runs
    assert result["warned_here"]  # torch's warning, pointing at the script's call
    if flag == "--budget":
        line = [line for line in done.stderr.splitlines() if "replaced" in line]
        assert "replaced 3 region(s) (2 torch.utils.checkpoint: recompute, 1 torch.utils.checkpoint: reentrant " \
               "recompute) by the plan" in line[0], done.stderr
        assert result["peak"] <= result["budget"], result
    else:
        assert "acshim: 6 region forwards, 6 recomputes" in done.stderr
        assert "torch.utils.checkpoint     3 region(s), 6 forwards, 6 recomputes" in done.stderr


@pytest.fixture(scope="module")
def plan_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``acshim plan --budget 40MiB --sweep`` on CHECKPOINT_WRAPPER asked for 5 steps, with ``--png
    frontier.png`` where matplotlib is installed: launched once for the table's test and the
    picture's; its folder (script, frontier.png) and the run."""
    folder = tmp_path_factory.mktemp("plan-sweep")
    script = _script(folder, CHECKPOINT_WRAPPER)
    png = ["--png", "frontier.png"] if importlib.util.find_spec("matplotlib") is not None else []
    return folder, _acshim("plan", "--budget", "40MiB", "--sweep", *png, "--", str(script), "5", cwd=folder,
                           env=PLANNABLE)


def test_plan_prints_table_and_frontier_and_exits_before_training_on(
        plan_sweep: tuple[Path, subprocess.CompletedProcess]) -> None:
    done = plan_sweep[1]
    assert done.returncode == 0, done.stderr
    assert "trained step" not in done.stdout  # stopped inside the first step
    out = done.stdout.splitlines()
    assert out[0] == "acshim plan: budget 40.0 MiB (peak activation memory)"
    rows = {m.group(1): m.group(2) for line in out if (m := re.match(r"^(h\.\d)\S*\s+(\S+)", line))}
    assert sorted(rows) == ["h.0", "h.1", "h.2", "h.3"]
    known = ("keep", "selective", "selective-alt", "recompute", "offload:disk", "recompute+offload:disk")
    assert set(rows.values()) <= set(known)
    # the whole step (activations and what the process held besides) where the process is read
    predicted = re.search(r"predicted: (?:whole step ([\d.]+) MiB \(activations )?held [\d.]+ MiB, peak ([\d.]+) MiB",
                          done.stdout)
    assert predicted and float(predicted.group(1) or predicted.group(2)) <= 40.0, done.stdout
    assert float(predicted.group(2)) <= float(predicted.group(1) or predicted.group(2))
    start = out.index("frontier (predicted from the block profile)")
    end = out.index("baselines (every region the same, predicted)")
    points = [line.split() for line in out[start + 2:end]]
    assert len(points) >= 3
    steps = [float(p[5]) for p in points]  # step ms column
    # more memory, never slower (but for a chunked head, taken only when faster beyond NOISE)
    assert all(later <= earlier * (1 + NOISE) for earlier, later in zip(steps, steps[1:]))
    assert any(line.strip().startswith("none") for line in out[end:])


DEEPSPEED_CONFIG_ONLY = MODEL + """
import deepspeed
deepspeed.checkpointing.configure(None, deepspeed_config={
    "train_batch_size": 2, "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True}})
model = build()
model.gradient_checkpointing = True   # the script believes the config checkpoints its blocks
acshim.apply_checkpointing(model)     # but only acshim's own regions run
for step in range(2):
    train_step(model, ids)
"""


def test_report_flags_deepspeed_config_block_nothing_reads(tmp_path: Path) -> None:
    script = _script(tmp_path, DEEPSPEED_CONFIG_ONLY)
    done = _acshim("run", "--report", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "DeepSpeed config a dict has an activation_checkpointing block, but nothing called " \
           "deepspeed.checkpointing.checkpoint" in done.stderr
    assert "cpu_checkpointing is on, but no DeepSpeed checkpoint ran (regions that ran: acshim)" in done.stderr


DEEPSPEED_INITIALIZE = MODEL + """
import json, deepspeed
with open("ds_config.json", "w") as handle:   # the usual place: a JSON file given to deepspeed.initialize
    json.dump({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4}}, handle)
model = build()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")
for step in range(2):                          # nothing calls deepspeed.checkpointing.checkpoint
    loss = engine(ids)
    engine.backward(loss)
    engine.step()
print("trained", step)
"""


def test_report_flags_the_block_of_a_config_given_to_deepspeed_initialize(tmp_path: Path) -> None:
    """The DeepSpeed engine never reads ``activation_checkpointing``: a block in the config given to
    ``deepspeed.initialize`` with no ``deepspeed.checkpointing.checkpoint`` call does nothing."""
    pytest.importorskip("deepspeed")
    script = _script(tmp_path, DEEPSPEED_INITIALIZE)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    done = subprocess.run([sys.executable, "-m", "acshim", "run", "--report", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 1" in done.stdout
    assert "DeepSpeed config ds_config.json (given to deepspeed.initialize) has an activation_checkpointing block, " \
           "but nothing called deepspeed.checkpointing.checkpoint" in done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


NESTED_AND_CACHE = MODEL + """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
model = build()
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPTBlock))
for step in range(2):
    train_step(model, ids)
"""


def test_report_counts_regions_per_dialect_and_finds_nothing_wrong(tmp_path: Path) -> None:
    script = _script(tmp_path, NESTED_AND_CACHE)
    done = _acshim("run", "--report", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "acshim: 8 region forwards, 8 recomputes" in err
    rows = re.findall(r"^\s+(GPTBlock#\d)\s+torch checkpoint_wrapper\s+(\d+)\s+(\d+)\s+([\d.]+) (?:KiB|MiB)", err, re.M)
    assert [(r[0], r[1], r[2]) for r in rows] == [(f"GPTBlock#{i}", "2", "2") for i in range(4)]
    assert all(float(r[3]) > 0 for r in rows)  # each keeps its input for the recompute
    assert "torch checkpoint_wrapper   4 region(s), 8 forwards, 8 recomputes" in err
    assert "nothing (no storage tier was used)" in err
    assert "settings that do nothing: none found" in err


HF_PATHS = """
import sys, torch, transformers
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64,
                                                             n_positions=32, bos_token_id=0, eos_token_id=0)).train()
path = sys.argv[1]
if path == "gradient_checkpointing_enable":
    model.gradient_checkpointing_enable()
elif path == "checkpoint_wrapper":
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPT2Block))
elif path == "closure":                                # the custom(module) idiom, one closure per block
    model.config.use_cache = False                     # a cache captured by the closure would be written twice
    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block
        def forward(self, hidden, *rest, **kwargs):
            block = self.block
            def custom(x):
                return block(x, *rest, **kwargs)
            return torch.utils.checkpoint.checkpoint(custom, hidden, use_reentrant=False)
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = Checkpointed(block)
for step in range(2):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
"""


@pytest.mark.parametrize(("path", "flags", "dialect"), [
    ("gradient_checkpointing_enable", [], "hf"),
    ("as-built", ["--hf"], "hf"),
    ("checkpoint_wrapper", [], "torch checkpoint_wrapper"),
    ("closure", [], "torch.utils.checkpoint"),
])
def test_report_names_one_row_per_hf_block_whichever_path_made_it(tmp_path: Path, path: str, flags: list[str],
                                                                 dialect: str) -> None:
    """A Hugging Face GPT-2's 4 blocks, checkpointed by its own switch, by --hf, by a dialect's
    wrapper or by a closure per block: 4 rows named GPT2Block#0..3, and the counts agree with the
    --budget line's."""
    pytest.importorskip("transformers")
    script = _script(tmp_path, HF_PATHS)
    done = _acshim("run", "--report", "--budget", "1GiB", *flags, str(script), path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"replaced 4 region\(s\) \(4 {re.escape(dialect)}: ", done.stderr), done.stderr[-3000:]
    rows = re.findall(r"^  (\S+)\s+(.+?)\s+(\d+)\s+(\d+)\s+[\d.]+ (?:KiB|MiB)$", done.stderr, re.M)
    assert [(name, where.strip(), forwards) for name, where, forwards, _ in rows] == [
        (f"GPT2Block#{i}", dialect, "2") for i in range(4)], done.stderr[-3000:]
    assert re.search(rf"^  {re.escape(dialect)}\s+4 region\(s\), 8 forwards", done.stderr, re.M), done.stderr[-3000:]


def test_report_flags_a_block_checkpointed_twice(tmp_path: Path) -> None:
    script = _script(tmp_path, NESTED_AND_CACHE.replace(
        "for step in range(2):", "acshim.apply_checkpointing(model, 'h.*.fc')\nfor step in range(2):"))
    done = _acshim("run", "--report", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"checkpointing requested twice: region Linear#\d \(acshim\) runs inside region GPTBlock#\d",
                     done.stderr), done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--budget", "0", "train.py"], "acshim run: argument --budget 0: budget must be positive"),
    (["run", "--budget", "lots", "train.py"], "acshim run: argument --budget lots: cannot parse budget 'lots'"),
    (["run", "--budget", "-1GiB", "train.py"], "acshim run: argument --budget -1GiB: cannot parse budget"),
    (["run", "--budget", "2.5", "train.py"], "acshim run: argument --budget 2.5: a float budget is a fraction in (0, 1]"),
    (["run", "--budget"], "acshim run: argument --budget: expected a value"),
    (["run", "--storage", "disk", "train.py"], "--storage chooses the offload tier of a --budget plan; add --budget"),
    (["plan", "train.py"], "acshim plan: argument --budget is required"),
    (["plan", "--budget", "1GiB", "--storage", "tape", "train.py"], "argument --storage: expected host or disk"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path: Path, args: list[str], message: str) -> None:
    _script(tmp_path, "raise SystemExit('the script must not run')\n")
    done = _acshim(*args, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr, done.stderr


def test_script_without_regions_under_budget_exits_2(tmp_path: Path) -> None:
    script = _script(tmp_path, MODEL + "train_step(build(), ids)\nprint('trained')\n")
    done = _acshim("run", "--budget", "0.5", str(script), cwd=tmp_path)
    assert done.returncode == 2
    assert "trained" in done.stdout
    assert "--budget 0.5: the script ran no checkpointed region" in done.stderr


ENDINGS = {
    "sys.exit(main())": "sys.exit(main())",          # main returns None
    "sys.exit(0)": "main()\nsys.exit(0)",
    "raise SystemExit": "main()\nraise SystemExit",
    "falls off the end": "main()",
}


@pytest.mark.parametrize("verb", ["run", "plan"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_script_without_regions_ends_the_same_whichever_way_it_exits(tmp_path: Path, ending: str, verb: str) -> None:
    """A successful exit (``sys.exit(None)`` / ``sys.exit(0)`` / ``raise SystemExit`` / the end of the
    file) is the end of the run: nothing was planned, so exit 2 saying so, in every case."""
    script = _script(tmp_path, "import sys\ndef main():\n    print('trained')\n" + ENDINGS[ending] + "\n")
    done = _acshim(verb, "--budget", "0.5", str(script), cwd=tmp_path, timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "trained" in done.stdout
    assert f"acshim {verb}: --budget 0.5: the script ran no checkpointed region" in done.stderr


def test_script_failing_exit_status_is_kept_under_budget(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('failed')\nsys.exit(3)\n")
    done = _acshim("run", "--budget", "0.5", str(script), cwd=tmp_path, timeout=300)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "checkpointed region" not in done.stderr  # the script's own failure is its own message


PROGRESS_THEN_REFUSED = MODEL + """
from tqdm import tqdm
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
model = build()
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPTBlock))
for step in tqdm(range(3), mininterval=0):               # its line is unfinished while a step runs
    train_step(model, ids)
"""


def test_refused_budget_error_starts_its_own_line_and_reports_no_run(tmp_path: Path) -> None:
    """A budget below the least achievable peak: the error begins a line of its own (not after the
    script's tqdm bar) and ``--report`` prints nothing about the run that did not happen."""
    pytest.importorskip("tqdm")
    script = _script(tmp_path, PROGRESS_THEN_REFUSED)
    done = _acshim("run", "--report", "--budget", "1KiB", str(script), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.split("\n")  # "\r" (tqdm's redraw) is not a line break on a terminal
    refused = [line for line in lines if "acshim run: --budget 1KiB:" in line]
    assert len(refused) == 1 and refused[0].startswith("acshim run: --budget 1KiB:"), done.stderr
    assert "pass --budget" in refused[0], done.stderr
    assert "acshim report" not in done.stderr and "region forwards" not in done.stderr, done.stderr


COMPILED = MODEL + """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.utils.checkpoint import checkpoint
from torch._dynamo.utils import counters
class TorchCheckpointed(torch.nn.Module):      # h.0 through torch's own checkpoint, the rest the facade's
    def __init__(self, block):
        super().__init__()
        self.block = block
    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)
model = build()
model.h[0] = TorchCheckpointed(model.h[0])
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPTBlock) and m is not model.h[0].block)
compiled = torch.compile(model, backend="aot_eager")
compiled(ids).backward()
print("trained", dict(counters["stats"]), len(counters["graph_break"]))
"""


@pytest.mark.parametrize("flag", ["--budget", "--report"])
def test_compiled_script_one_graph_under_report_and_budget_says_plan_before_compiling(tmp_path: Path,
                                                                                     flag: str) -> None:
    """Regions traced by Dynamo (torch's checkpoint, routed, and a facade's) stay one graph without
    breaks under ``--report`` (noted as not counted); ``--budget`` cannot plan them and says how to."""
    script = _script(tmp_path, COMPILED)
    done = _acshim("run", *([flag, "0.5"] if flag == "--budget" else [flag]), str(script), cwd=tmp_path)
    assert "trained {'calls_captured'" in done.stdout and "'unique_graphs': 1} 0" in done.stdout, done.stdout
    if flag == "--budget":
        assert done.returncode == 2, done.stderr
        assert "--budget 0.5: the script compiles its model (torch.compile)" in done.stderr
        assert "plan.apply(model); model = torch.compile(model)" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert "torch.compile ran: regions inside compiled graphs run as torch's checkpoint operator" in done.stderr


TRAINER = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=128,
                                   bos_token_id=0, eos_token_id=0))
g = torch.Generator().manual_seed(1)
data = [{"input_ids": torch.randint(0, 128, (128,), generator=g), "labels": torch.randint(0, 128, (128,), generator=g)}
        for _ in range(8)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
                         save_strategy="no", gradient_checkpointing=sys.argv[1] == "gc", seed=0)
Trainer(model=model, args=args, train_dataset=data).train()
torch.save(model.state_dict(), sys.argv[2])
"""


def test_hf_trainer_under_budget_trains_exactly_as_without_checkpointing(tmp_path: Path) -> None:
    """An unchanged Trainer script (gradient_checkpointing=True, dropout on) under --budget: its
    blocks follow the plan, and the weights after two optimizer steps are bitwise those of the run
    without checkpointing."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = _script(tmp_path, TRAINER)
    plain = subprocess.run([sys.executable, str(script), "off", "plain.pt"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # 0.9: the Trainer pages in ~34 MiB of code on its first step, charged to the plan (docs/planner.md)
    planned = _acshim("run", "--budget", "0.9", str(script), "gc", "planned.pt", cwd=tmp_path,
                      env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert re.search(r"acshim: --budget .*replaced 4 region\(s\) \(4 hf: recompute\) by the plan", planned.stderr)
    import torch

    reference, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "planned.pt")
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)


def test_plan_sweep_writes_the_frontier_png(plan_sweep: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``--png`` with the optional 'plot' extra: one step's memory block by block beside the frontier
    (``acshim plan``: the run the table's test checks, launched once for both), and the same picture
    from ``acshim run --budget`` once it has planned."""
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from acshim.planner import picture

    tmp_path, done = plan_sweep
    script = tmp_path / "train.py"
    assert done.returncode == 0, done.stderr
    png = (tmp_path / "frontier.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "frontier.png" in done.stdout
    size = (int(picture.SIZE_INCHES[1] * picture.DPI), int(picture.SIZE_INCHES[0] * picture.DPI))
    assert matplotlib.image.imread(tmp_path / "frontier.png").shape[:2] == size
    done = _acshim("run", "--budget", "0.45", "--png", "run.png", str(script), "1", cwd=tmp_path, env=PLANNABLE)
    assert done.returncode == 0, done.stderr
    assert "acshim: wrote run.png" in done.stderr and _result(done.stdout)["equal"]
    assert matplotlib.image.imread(tmp_path / "run.png").shape[:2] == size
    done = _acshim("run", "--png", "x.png", str(script), cwd=tmp_path)
    assert done.returncode == 2 and "--png draws a --budget plan's memory" in done.stderr


def test_plan_file_is_written_then_reused_without_profiling_and_refused_for_another_budget(
        planned_with_plan_file: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``--plan-file``: the run that plans writes it; the next run of the same script, batch and
    budget uses it without profiling (gradients bitwise as without checkpointing); another budget or
    model is refused with exit 2 naming what differs."""
    tmp_path, first = planned_with_plan_file  # the run the first test checks, launched once for both
    script = tmp_path / "train.py"
    assert first.returncode == 0, first.stderr
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["format"] == "acshim-plan/1" and "reused" not in first.stderr
    again = _acshim("run", "--budget", "0.7", "--plan-file", "plan.json", str(script), "2", cwd=tmp_path, env=PLANNABLE)
    assert again.returncode == 0, again.stderr
    assert "reused from plan.json (not profiled again)" in again.stderr
    assert f"by the plan ({_counts(saved['choices'])}" in again.stderr
    assert _result(again.stdout)["equal"]
    other = _acshim("run", "--budget", "0.5", "--plan-file", "plan.json", str(script), "2", cwd=tmp_path,
                    env=PLANNABLE)
    assert other.returncode == 2 and "--plan-file plan.json: it was made for a budget of" in other.stderr
    wider = _acshim("run", "--budget", "0.7", "--plan-file", "plan.json", str(script), "2", cwd=tmp_path,
                    env={**PLANNABLE, "TEST_WIDTH": "128"})
    assert wider.returncode == 2 and "it was made for another model" in wider.stderr, wider.stderr[-2000:]
    bad = _acshim("run", "--plan-file", "plan.json", str(script), cwd=tmp_path)
    assert bad.returncode == 2 and "--plan-file saves or reuses a --budget plan; add --budget" in bad.stderr


def _counts(choices: list[str]) -> str:
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in counts.items())

"""Fine-tuning scripts unchanged under ``acshim run --budget 0.5``: PEFT's SFT script shape (LoRA on a
frozen tiny Llama, ``use_reentrant=True``) and TRL's ``sft.py`` shape (``SFTTrainer``), a vocabulary of
32k (issue 18 item 1). What dominates there lies outside the blocks (the head and the loss over the
vocabulary), so only a plan with ``acshim.head``'s choices meets the budget; the adapters after the
run are bitwise those of the run without checkpointing, and the planned steps' RSS peak is within
the budget (subprocesses: the patches are process-wide)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "finetuning"
PROBE = Path(__file__).resolve().parent / "scripts" / "rss_probe.py"
COMMON = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--report_to", "none", "--seed", "3",
          "--save_strategy", "no", "--max_length", "128", "--dataloader_num_workers", "0", "--bf16", "False",
          "--use_cpu", "True", "--disable_tqdm", "True"]
CASES = {
    "peft": (SCRIPTS / "peft_sft_train.py", ["--use_peft_lora", "True", "--lora_r", "8", "--use_reentrant", "True"],
             "--gradient_checkpointing"),
    "trl": (SCRIPTS / "trl_sft.py", ["--use_peft", "--lora_r", "8"], "--gradient_checkpointing"),
}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from acshim.testing import write_finetuning_fixture

    directory = tmp_path_factory.mktemp("finetune")
    write_finetuning_fixture(str(directory))
    return directory


def _run(directory: Path, case: str, output: str, budget: str | None, refused: bool = False) -> dict:
    """The script as a user runs it (no ``MALLOC_*`` or thread variable), its resident high-water mark
    above the first training step's start (planning counted: ``RSS_PROBE_FROM_STEP=1``)."""
    script, extra, checkpointing = CASES[case]
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(directory / "datasets"), TOKENIZERS_PARALLELISM="false",
               RSS_PROBE_FROM_STEP="1")
    args = [str(PROBE), str(script), "--model_name_or_path", str(directory / "model"), "--dataset_name",
            str(directory / "data"), "--output_dir", str(directory / output), checkpointing,
            "True" if budget else "False", *extra, *COMMON]
    command = [sys.executable, *(["-m", "acshim", "run", "--budget", budget] if budget else []), *args]
    return _outcome(subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=600))


def _outcome(done: subprocess.CompletedProcess) -> dict:
    """What a run printed: its ``RSS`` line, or, where ``acshim run`` refused the budget (exit 2),
    the budget the refusal names (``named``)."""
    if done.returncode == 2:
        named = re.search(r"pass --budget (\S+) or more", done.stderr)
        assert named, done.stderr[-4000:]
        return {"named": named.group(1), "stderr": done.stderr}
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RSS ")][-1]
    return {**json.loads(line[4:]), "stderr": done.stderr}


def _within(planned: dict) -> None:
    """The whole run, planning included, within the budget it planned at by ``VmHWM`` (2% for pages)."""
    assert planned["budget"] is not None and planned["peak"] <= planned["budget"] * 1.02, \
        (planned["peak"] / planned["budget"], {k: v for k, v in planned.items() if k != "stderr"},
         planned["stderr"][-2000:])


@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_script_at_half_or_the_budget_it_names_trains_exactly_within_it(fixture_dir: Path, case: str) -> None:
    """The SFT scripts (LoRA on a frozen tiny Llama with a 32k vocabulary) at ``--budget 0.5``: before,
    PEFT's planned at 67.6 MiB and peaked at 105.7 MiB over the whole run, the frozen base's mapped
    weights and the code its first step paged in (41 MiB of file-backed pages) uncharged. Now those
    are charged: 0.5 either plans or is refused naming a budget; at the budget it planned at, the
    whole run stays within it, below the plain run's peak, and the adapters are bitwise those of the
    run without checkpointing; the whole step's predicted and measured peaks agree within 10%."""
    from safetensors.torch import load_file

    plain = _run(fixture_dir, case, f"{case}-plain", None)
    planned = _run(fixture_dir, case, f"{case}-planned", "0.5")
    if "named" in planned:  # the frontier's least budget, the part outside measured for the refusal
        assert "charged besides" in planned["stderr"], planned["stderr"][-3000:]
        assert "the least peak the planner predicts" in planned["stderr"], planned["stderr"][-3000:]
        planned = _run(fixture_dir, case, f"{case}-planned", planned["named"])
    assert "replaced 4 region(s)" in planned["stderr"], planned["stderr"][-3000:]
    # item 2: the whole step's predicted and measured peaks, as the run prints them, within 10% (or 2 MiB)
    found = re.search(r"replaced 4 region\(s\).*predicted peak ([\d.]+) MiB.*?, measured ([\d.]+) MiB",
                      planned["stderr"])
    assert found, planned["stderr"][-3000:]
    predicted, measured = float(found.group(1)), float(found.group(2))
    assert abs(predicted - measured) <= max(0.1 * measured, 2.0), (predicted, measured)
    _within(planned)
    assert planned["peak"] < plain["peak"], (planned["peak"], plain["peak"])
    reference = load_file(fixture_dir / f"{case}-plain" / "adapter_model.safetensors")
    got = load_file(fixture_dir / f"{case}-planned" / "adapter_model.safetensors")
    assert set(got) == set(reference) and all(k.count("lora_") for k in got)
    assert all(__import__("torch").equal(got[k], reference[k]) for k in got)


TRL_SFT = Path(importlib.util.find_spec("trl.scripts.sft").origin) if importlib.util.find_spec("trl") else None


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from acshim.testing import write_finetuning_fixture

    directory = tmp_path_factory.mktemp("finetune512")
    write_finetuning_fixture(str(directory), vocab=512, hidden=128, layers=6, rows=48, words=120)
    return directory


def _trl_own(directory: Path, output: str, budget: str | None) -> dict:
    """TRL's own ``trl/scripts/sft.py``, unchanged, as a user runs it (no ``MALLOC_*`` or thread
    variable), measured from its first training step's start."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(directory / "datasets"), TOKENIZERS_PARALLELISM="false",
               RSS_PROBE_FROM_STEP="1")
    args = [str(PROBE), str(TRL_SFT), "--model_name_or_path", str(directory / "model"), "--dataset_name",
            str(directory / "data"), "--output_dir", str(directory / output), "--gradient_checkpointing",
            "True" if budget else "False", "--max_steps", "6", "--per_device_train_batch_size", "8",
            "--report_to", "none", "--seed", "3", "--save_strategy", "no", "--max_length", "121",
            "--dataloader_num_workers", "0", "--bf16", "False", "--use_cpu", "True", "--disable_tqdm", "True"]
    command = [sys.executable, *(["-m", "acshim", "run", "--budget", budget] if budget else []), *args]
    return _outcome(subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=600))


def test_trl_own_sft_script_keeps_the_budget_it_plans_at_with_weights_bitwise(small_vocab_dir: Path) -> None:
    """Issue 26 item 1: ``trl/scripts/sft.py`` (a 6x128 Llama, vocabulary 512, batch 8, 6 steps). Its
    fractions were of a no-checkpointing peak predicted at 172 MiB, where the process peaks at 76 MiB
    (the step on fake tensors counted the chunked log-prob's 120 MiB ``torch.empty`` buffer whole),
    and its whole run went 1.03x (0.5) and 1.10x (0.3) over. Then the fractions were of the
    activations' peak and the code paged in alone (80.8 MiB), and 0.5 was refused. Now they are of
    no checkpointing's predicted whole step (what a step holds besides its activations included, as
    in each plan's prediction): 0.5 plans (in a freshly installed environment, whose first step
    pages in twice the code, it is refused naming the frontier's least budget); where it plans, the
    predicted and measured whole-step peaks are within 10% of each other, the whole run within the
    budget, the saved weights equal to the plain run's bitwise."""
    import torch
    from safetensors.torch import load_file

    plain = _trl_own(small_vocab_dir, "plain", None)
    reference = load_file(small_vocab_dir / "plain" / "model.safetensors")
    planned = _trl_own(small_vocab_dir, "planned", "0.5")
    if "named" in planned:  # a fresh install pages in twice the code (17.5 MiB against 8.4 MiB here)
        assert "the least peak the planner predicts" in planned["stderr"], planned["stderr"][-3000:]
        planned = _trl_own(small_vocab_dir, "planned", planned["named"])
    found = re.search(r"replaced 6 region\(s\).*predicted peak ([\d.]+) MiB.*?, measured ([\d.]+) MiB",
                      planned["stderr"])
    assert found, planned["stderr"][-3000:]
    predicted, measured = float(found.group(1)), float(found.group(2))
    assert abs(predicted - measured) <= max(0.1 * measured, 2.0), (predicted, measured)
    _within(planned)
    assert planned["peak"] < plain["peak"], (planned["peak"], plain["peak"])
    got = load_file(small_vocab_dir / "planned" / "model.safetensors")
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
    # 0.3 is below full recompute with the disk tier here (a block's recompute holds 15 MiB, the
    # fused head's backward 20 MiB, AdamW's state 8.5 MiB): refused, naming the frontier's least
    # budget (the part outside the blocks measured for the refusal; before, 3 times how far its
    # stopped measurement got, 86.4 MiB), below the plain run's peak; it plans within it
    tighter = _trl_own(small_vocab_dir, "planned0.3", "0.3")
    if "named" in tighter:
        assert "the least peak the planner predicts" in tighter["stderr"], tighter["stderr"][-3000:]
        named = tighter["named"]
        tighter = _trl_own(small_vocab_dir, "planned0.3", named)
        assert tighter["budget"] is not None and tighter["budget"] < plain["peak"], (named, plain["peak"])
    _within(tighter)

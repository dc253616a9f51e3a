"""Hugging Face models under DDP with ``find_unused_parameters=True`` on real gloo ranks (torchrun,
2 processes, ``-m acshim run``): checkpointing switched on by ``gradient_checkpointing_enable``
(reentrant, where torch's reentrant checkpoint fails with "Expected to mark a variable ready only
once", and the default) or by ``--hf``, on GPT-2 and Llama, gives every rank's gradients after the
allreduce bitwise equal to DDP without checkpointing (dropout on). Run on both transformers majors
(README's second CI command)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "hf_ddp_checkpointing.py")


def _gradients(directory: Path, case: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    return [torch.load(directory / f"{case}-rank{rank}.pt") for rank in (0, 1)]


def _assert_bitwise_equal(got: list[dict], expected: list[dict], case: str) -> None:
    for rank, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        for arch in ("gpt2", "llama"):
            assert mine[arch].keys() == reference[arch].keys(), (case, rank, arch)
            differing = [name for name in reference[arch] if not torch.equal(mine[arch][name], reference[arch][name])]
            assert not differing, f"{case}, rank {rank}, {arch}: gradients differ for {differing[:5]}"


def test_hf_models_under_ddp_find_unused_parameters_get_exact_gradients_from_every_checkpointing_path(
        launch, torchrun, tmp_path) -> None:
    script = launch(torchrun("-m", "acshim", "run", SCRIPT, "--out", str(tmp_path),
                             "--case", "none", "--case", "reentrant", "--case", "default"), timeout=300)
    assert script.returncode == 0, script.stderr[-4000:]
    # every block of both models ran on the engine, on both ranks: 2 models x 4 blocks x 2 steps x 2 cases
    assert script.region_counts() == ["acshim: 32 region forwards, 32 recomputes"] * 2, script.stderr[-2000:]
    reference = _gradients(tmp_path, "none")
    for case in ("reentrant", "default"):
        _assert_bitwise_equal(_gradients(tmp_path, case), reference, case)

    hf = launch(torchrun("-m", "acshim", "run", "--hf", SCRIPT, "--out", str(tmp_path),
                         "--case", "reentrant", "--case", "as-built"), timeout=300)
    assert hf.returncode == 0, hf.stderr[-4000:]
    assert hf.region_counts() == ["acshim: 32 region forwards, 32 recomputes"] * 2, hf.stderr[-2000:]
    for case in ("reentrant", "as-built"):
        _assert_bitwise_equal(_gradients(tmp_path, case), reference, f"--hf {case}")

"""acshim.plan on Hugging Face models left with their default ``use_cache``: profiling runs each
block on what a region would receive (the cache dropped), and the planned model trains exactly."""

from __future__ import annotations

import pytest
import torch

import acshim

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plan_profiles_cached_blocks_and_trains_exactly(family: str) -> None:
    model = acshim.testing.hf_model(family)
    model.train()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads()
    plan = acshim.plan(model, {"input_ids": ids, "labels": ids}, budget=0.5, memory="tensors")  # use_cache: default
    plan.apply(model)
    got = grads()
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)

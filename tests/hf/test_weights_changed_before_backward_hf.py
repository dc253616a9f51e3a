"""Hugging Face's gradient checkpointing routed to acshim, weights stepped before backward (issue 28.1).

An optimizer (or EMA written back into the model) stepping between ``model(**batch)`` and
``loss.backward()``: every checkpointed decoder layer's recompute would read the stepped weights.
The run without checkpointing raises torch's in-place error (the weights are saved), and so must
both modes through acshim; torch's own checkpoint recomputes from the new weights silently.
"""

from __future__ import annotations

import pytest
import torch

import acshim.hf as hf
from acshim.testing import hf_inputs, hf_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_an_optimizer_step_before_backward_raises_torchs_error(arch: str, reentrant: bool) -> None:
    hf.install()
    model = hf_model(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    layers = [p for name, p in model.named_parameters() if ".h." in name or ".layers." in name]
    optimizer = torch.optim.AdamW(layers, lr=1e-3)  # the decoder layers' weights: checkpointed ones
    loss = model(**hf_inputs(arch)).loss
    for p in layers:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's decoupled weight decay moves every weight
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        loss.backward()
    assert "before backward recomputed that region" in str(raised.value)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_the_usual_order_trains_and_steps(reentrant: bool) -> None:
    """forward, backward, step, then the next forward: no error, and the next step's gradients are
    bitwise those of the run without checkpointing."""

    def two_steps(checkpointing: bool) -> list[torch.Tensor]:
        model = hf_model("llama")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for seed in (1, 2):
            torch.manual_seed(seed)
            optimizer.zero_grad(set_to_none=True)
            model(**hf_inputs("llama")).loss.backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    expected = two_steps(False)
    hf.install()
    actual = two_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))

"""A GPT-2 training with ``use_cache`` at the model default (on), its blocks checkpointed through
every non-Hugging Face dialect (issue 8, item 3): the model builds a ``DynamicCache`` and hands it
to each block; without care the recompute appends the keys a second time and gradients are wrong
(by up to 0.09) while the loss is unchanged.

Expected gradients are the run without checkpointing and with ``use_cache=False``, which is what a
checkpointed block runs (as with Hugging Face's own gradient checkpointing). Not the cache-on run:
on AMD CPUs MKL picks another matmul kernel for the cached keys' layout, so a cache-on run can differ
from the cache-off run in the last bit with no checkpointing at all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import acshim
from acshim.region_state import USE_CACHE_WARNING
from acshim.testing import assert_bitwise_equal, hf_inputs, hf_model, train_step

transformers = pytest.importorskip("transformers")


def _torch_facade(impl_name: str) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )
        blocks = model.transformer.h
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, checkpoint_impl=getattr(CheckpointImpl, impl_name))
    return apply


def _torch_installed(model: nn.Module) -> None:
    """``acshim.install()``, then the script's own import of torch's checkpoint_wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT),
        check_fn=lambda m: isinstance(m, GPT2Block))


def _fairscale(model: nn.Module) -> None:
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    for block in model.transformer.h:
        checkpoint_wrapper(block)


def _deepspeed(model: nn.Module) -> None:
    """Megatron style: each block's forward calls ``deepspeed.checkpointing.checkpoint``."""
    from acshim.facades import deepspeed

    # DeepSpeed's checkpoint returns a one-element output unwrapped (upstream's rule), and GPT-2's
    # block returns a 1-tuple in transformers 4.x, so a Megatron-style wrapper puts it back.
    returns_tuple = int(transformers.__version__.split(".")[0]) < 5
    for block in model.transformer.h:
        forward = block.forward
        block.forward = lambda *args, _forward=forward, **kwargs: _retupled(deepspeed.checkpointing.checkpoint(
            _forward, *args, **kwargs), returns_tuple)


def _retupled(output: Any, returns_tuple: bool) -> Any:
    return (output,) if returns_tuple and isinstance(output, torch.Tensor) else output


def _apply(reentrant: bool) -> Callable[[nn.Module], None]:
    return lambda model: acshim.apply_checkpointing(model, reentrant=reentrant)


DIALECTS: dict[str, Callable[[nn.Module], None]] = {
    "torch-reentrant": _torch_facade("REENTRANT"),
    "torch-no-reentrant": _torch_facade("NO_REENTRANT"),
    "torch-installed": _torch_installed,
    "fairscale": _fairscale,
    "deepspeed": _deepspeed,
    "apply-reentrant": _apply(True),
    "apply-non-reentrant": _apply(False),
}


@pytest.fixture
def installed_if(request: pytest.FixtureRequest) -> Any:
    def setup(dialect: str) -> None:
        if dialect == "torch-installed":
            acshim.install()
            request.addfinalizer(acshim.uninstall)
    return setup


def _normalised(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.replace("_checkpoint_wrapped_module.", ""): value for key, value in state.items()}


def _cache_warnings(caught: list[warnings.WarningMessage]) -> int:
    return sum(str(w.message) == USE_CACHE_WARNING for w in caught)


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return train_step(hf_model("gpt2"), dict(hf_inputs("gpt2"), use_cache=False))


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_default_use_cache_gives_gradients_of_the_cache_off_run_and_warns_once(
        dialect: str, expected: dict[str, torch.Tensor], installed_if: Any) -> None:
    installed_if(dialect)
    model = hf_model("gpt2")
    assert model.config.use_cache  # the default this issue is about
    DIALECTS[dialect](model)
    inputs = hf_inputs("gpt2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _normalised(train_step(model, inputs))
        second = _normalised(train_step(model, inputs))
    assert_bitwise_equal(expected, first)
    assert_bitwise_equal(expected, second)
    assert _cache_warnings(caught) == 1


@pytest.mark.parametrize("dialect", ["torch-reentrant", "fairscale", "deepspeed", "apply-reentrant",
                                     "apply-non-reentrant"])
def test_the_cache_is_never_written_by_a_checkpointed_block(dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the model's own cache nor one the caller passes in expecting it filled: both come
    back empty, as with Hugging Face's gradient checkpointing."""
    writes: list[int] = []
    update = transformers.DynamicCache.update
    monkeypatch.setattr(transformers.DynamicCache, "update",
                        lambda self, *a, **k: writes.append(a[2] if len(a) > 2 else k.get("layer_idx")) or update(self, *a, **k))
    model = hf_model("gpt2")
    DIALECTS[dialect](model)
    inputs = hf_inputs("gpt2")
    own = model(**inputs)
    own.loss.backward()
    passed = transformers.DynamicCache(config=model.config)
    out = model(**inputs, past_key_values=passed, use_cache=True)
    out.loss.backward()
    assert writes == []
    assert own.past_key_values.get_seq_length() == 0
    assert out.past_key_values is passed and passed.get_seq_length() == 0


def test_smp_v1_prebuilt_hf_model_example_with_default_use_cache(
        expected: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """The SMP v1 dev guide's "prebuilt HF model" example, ``use_cache`` not passed."""
    import acshim.facades.smdistributed.modelparallel.torch as smp

    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    smp.state.reset()
    try:
        smp.init({"partitions": 1})
        model = smp.DistributedModel(hf_model("gpt2"))
        for block in model.get_module().transformer.h.children():
            smp.set_activation_checkpointing(block)

        @smp.step
        def train(model, input_ids, labels):
            loss = model(input_ids=input_ids, labels=labels).loss
            model.backward(loss)
            return loss

        inputs = hf_inputs("gpt2")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                loss = train(model, inputs["input_ids"], inputs["labels"])
                assert torch.equal(loss.reduce_mean(), expected["loss"])
                grads = {f"grad:{n}": p.grad for n, p in model.get_module().named_parameters()}
                assert grads.keys() == {k for k in expected if k.startswith("grad:")}
                assert all(torch.equal(expected[k], grads[k]) for k in grads)
        assert _cache_warnings(caught) == 1
    finally:
        smp.state.reset()

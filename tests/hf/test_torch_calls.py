"""Hugging Face models that call ``torch.utils.checkpoint.checkpoint`` themselves (CLVP's
conditioning encoder, Grounding DINO) instead of ``_gradient_checkpointing_func``: under
``acshim.install()`` (``acshim run``) those calls run on the engine too, with torch's defaults; calls
made from anywhere else stay torch's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import acshim
from acshim.region import STATS, TORCH_CHECKPOINT


@pytest.fixture
def installed_everything() -> Iterator[None]:
    acshim.install()
    try:
        yield
    finally:
        acshim.uninstall()
    assert torch_checkpoint.checkpoint is TORCH_CHECKPOINT


def _clvp_encoder(checkpointing: bool) -> nn.Module:
    from transformers import ClvpConfig, ClvpDecoderConfig, ClvpEncoderConfig
    from transformers.models.clvp.modeling_clvp import ClvpConditioningEncoder

    text = ClvpEncoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, projection_dim=16, bos_token_id=1, eos_token_id=2)
    decoder = ClvpDecoderConfig(vocab_size=64, max_position_embeddings=64, max_text_tokens=32, n_embd=32, n_layer=2,
                                n_head=2, feature_size=16, num_mel_attn_blocks=2)
    config = ClvpConfig(text_config=text.to_dict(), speech_config=text.to_dict(), decoder_config=decoder.to_dict())
    torch.manual_seed(0)
    encoder = ClvpConditioningEncoder(config).train()
    encoder.gradient_checkpointing = checkpointing  # what gradient_checkpointing_enable() sets on it
    return encoder


def _step(encoder: nn.Module) -> dict[str, torch.Tensor | None]:
    torch.manual_seed(5)
    features, ids = torch.randn(2, 16, 20), torch.randint(3, 60, (2, 8))
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):  # torch's
        encoder(input_features=features, input_ids=ids).square().sum().backward()
    return {name: parameter.grad for name, parameter in encoder.named_parameters()}


def test_transformers_model_calling_torch_checkpoint_itself_runs_on_the_engine_exactly(installed_everything) -> None:
    expected = _step_plain(_clvp_encoder(False))
    before = STATS.forwards, STATS.recomputes
    got = _step(_clvp_encoder(True))
    # mel_conv, then per attention block its group norm and the block: 1 + 2 x 2 regions on the engine
    assert (STATS.forwards - before[0], STATS.recomputes - before[1]) == (5, 5)
    missing = [name for name, grad in got.items() if grad is None]
    assert not missing, f"no gradient for {missing} (torch's reentrant checkpoint gives none: no input needs grad)"
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def _step_plain(encoder: nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    features, ids = torch.randn(2, 16, 20), torch.randint(3, 60, (2, 8))
    encoder(input_features=features, input_ids=ids).square().sum().backward()
    return {name: parameter.grad for name, parameter in encoder.named_parameters()}


def test_other_callers_keep_torchs_own_checkpoint(installed_everything) -> None:
    import transformers.modeling_utils  # noqa: F401  (the patches are in place once it is imported)

    block, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    before = STATS.forwards
    out = torch_checkpoint.checkpoint(block, x, use_reentrant=True)
    assert STATS.forwards == before and type(out.grad_fn).__name__ == "CheckpointFunctionBackward"
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly") as caught:
        out = torch_checkpoint.checkpoint(block, x)  # torch's warning and default, pointing at this line
    assert [w.filename for w in caught] == [__file__]
    assert STATS.forwards == before and type(out.grad_fn).__name__ == "CheckpointFunctionBackward"

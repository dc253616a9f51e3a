"""Modalities facade: the three activation-checkpointing variants, their errors and the FSDP1 path.

Encodes what Modalities' tests/training/test_activation_checkpointing.py checks (which blocks become
CheckpointWrapper, losses and gradients equal to the raw model) with a tiny GPT-2-like model whose
blocks live in a ModuleDict at ``transformer.h``, as in Modalities.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

import acshim.facades.modalities as modalities_root
from acshim.facades.modalities.config.config import ActivationCheckpointedModelConfig as Config
from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing_fsdp1_inplace,
    is_module_to_apply_activation_checkpointing,
)
from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing_variants import (
    ActivationCheckpointingVariants as Variants,
)
from acshim.measure import measure_memory
from acshim.testing import assert_bitwise_equal, train_step

apply_ac = ActivationCheckpointing.apply_activation_checkpointing_


class Block(nn.Module):
    """A GPT-2 block with bias-free projections (so matmuls reach the selective policy as aten.mm)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.fc1 = nn.Linear(width, 4 * width, bias=False)
        self.fc2 = nn.Linear(4 * width, width, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + self.dropout(self.proj(attention))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer.h.values():
            x = block(x)
        return self.head(x)


def gpt(seed: int = 42) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


VARIANTS = {
    "full": (Variants.FULL_ACTIVATION_CHECKPOINTING, Config.FullACParams(), ["0", "1", "2", "3"]),
    "selective_layer": (Variants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING, Config.SelectiveLayerACParams(ac_freq=2),
                        ["1", "3"]),
    "selective_op": (Variants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
                     Config.SelectiveOpACParams(save_ops_keys=["ops.aten.mm.default"]), ["0", "1", "2", "3"]),
}


def wrapped_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]


def unprefixed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.replace("_checkpoint_wrapped_module.", ""): value for key, value in state.items()}


@pytest.fixture(autouse=True)
def quiet(capsys):
    yield  # Modalities prints one progress line per layer; keep test output clean


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_wraps_the_upstream_layers_and_gradients_are_bitwise_equal(name):
    variant, params, expected_layers = VARIANTS[name]
    inputs = torch.randn(2, 16, 32)
    expected = train_step(gpt(), inputs)
    model = gpt()
    assert apply_ac(variant, "transformer.h", model, params) is None
    assert wrapped_names(model) == [f"transformer.h.{i}" for i in expected_layers]
    # Upstream passes preserve_rng_state=False, so with dropout its gradients differ; ours are exact.
    assert_bitwise_equal(expected, unprefixed(train_step(model, inputs)))


def test_variants_hold_less_than_the_raw_model_and_full_holds_least():
    inputs = torch.randn(2, 16, 32)
    raw = measure_memory(gpt(), inputs).held_bytes
    held = {}
    for name, (variant, params, _) in VARIANTS.items():
        model = gpt()
        apply_ac(variant, "transformer.h", model, params)
        held[name] = measure_memory(model, inputs).held_bytes
    assert held["full"] < held["selective_op"] < raw
    assert held["full"] < held["selective_layer"] < raw


def test_selective_layer_counter_does_not_leak_between_models():
    # Upstream keeps the count on torch's checkpoint_wrapper function: the second model would get h.0, h.2.
    params = Config.SelectiveLayerACParams(ac_freq=2)
    for _ in range(3):
        model = gpt()
        apply_ac(Variants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING, "transformer.h", model, params)
        assert wrapped_names(model) == ["transformer.h.1", "transformer.h.3"]
    model = gpt()
    apply_ac(Variants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING, "transformer.h", model,
             Config.SelectiveLayerACParams(ac_freq=3))
    assert wrapped_names(model) == ["transformer.h.2"]


class CountMatmuls(TorchDispatchMode):
    """Counts aten.mm executions; saved outputs are served from the selective cache and not executed."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func == torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def backward_matmuls(variant, params) -> int:
    model = gpt()
    apply_ac(variant, "transformer.h", model, params)
    loss = model(torch.randn(2, 16, 32)).sum()
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count


def test_selective_op_saves_listed_ops_except_every_second_matmul():
    full = backward_matmuls(Variants.FULL_ACTIVATION_CHECKPOINTING, Config.FullACParams())
    save_mm = backward_matmuls(Variants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
                               Config.SelectiveOpACParams(save_ops_keys=["ops.aten.mm.default"]))
    save_max = backward_matmuls(Variants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
                                Config.SelectiveOpACParams(save_ops_keys=["ops.aten.max.default"]))
    # Each block runs 4 matmuls (qkv, proj, fc1, fc2): the 1st and 3rd are kept, so 2 per block
    # (8 in all) are not recomputed; with only aten.max listed every matmul is recomputed.
    assert full - save_mm == 8
    assert save_max == full


def test_variant_may_be_given_as_its_string_value():
    model = gpt()
    apply_ac("full_activation_checkpointing", "transformer.h", model, Config.FullACParams())
    assert len(wrapped_names(model)) == 4


def test_errors_match_upstream_wording():
    with pytest.raises(ValueError, match="Unknown activation checkpointing variant: bogus"):
        apply_ac("bogus", "transformer.h", gpt(), Config.FullACParams())
    with pytest.raises(ValueError, match="No save_ops_keys provided for selective op activation checkpointing."):
        apply_ac(Variants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING, "transformer.h", gpt(),
                 Config.SelectiveOpACParams(save_ops_keys=[]))
    with pytest.raises(ValueError, match="layers_fqn transformer does not reference a ModuleDict"):
        apply_ac(Variants.FULL_ACTIVATION_CHECKPOINTING, "transformer", gpt(), Config.FullACParams())
    with pytest.raises(AttributeError):
        apply_ac(Variants.FULL_ACTIVATION_CHECKPOINTING, "transformer.layers", gpt(), Config.FullACParams())


def test_bad_parameters_fail_at_apply_time_naming_the_fix():
    model = gpt()
    with pytest.raises(KeyError, match="save_ops_keys: unknown key"):
        apply_ac(Variants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING, "transformer.h", model,
                 Config.SelectiveOpACParams(save_ops_keys=["ops.aten.bmm.default"]))
    assert wrapped_names(model) == []  # nothing half-applied

    class LooseParams:
        ac_freq = 0

    with pytest.raises(ValueError, match="ac_freq must be an integer >= 1"):
        apply_ac(Variants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING, "transformer.h", gpt(), LooseParams())


def test_parameter_classes_validate_like_the_pydantic_config():
    assert Config.SelectiveLayerACParams(ac_freq=2).ac_freq == 2
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match="ac_freq"):
            Config.SelectiveLayerACParams(ac_freq=bad)
    with pytest.raises(ValueError, match="save_ops_keys"):
        Config.SelectiveOpACParams(save_ops_keys="ops.aten.mm.default")
    with pytest.raises(ValueError, match="required"):
        Config.SelectiveOpACParams()
    config = Config(ac_variant="full_activation_checkpointing", layers_fqn="transformer.h", model=gpt(),
                    ac_fun_params=Config.FullACParams())
    assert config.ac_variant is Variants.FULL_ACTIVATION_CHECKPOINTING


def test_save_dict_keys_and_variant_values_match_upstream():
    assert list(ActivationCheckpointing.SAVE_DICT) == [
        "ops.aten.mm.default", "ops.aten._scaled_dot_product_efficient_attention.default",
        "ops.aten._scaled_dot_product_flash_attention.default", "ops._c10d_functional.reduce_scatter_tensor.default",
        "ops.aten.max.default"]
    assert ActivationCheckpointing.SAVE_DICT["ops.aten.mm.default"] is torch.ops.aten.mm.default
    assert [v.value for v in Variants] == ["full_activation_checkpointing", "selective_layer_activation_checkpointing",
                                          "selective_op_activation_checkpointing"]


def test_progress_messages_are_printed_as_upstream(capsys):
    apply_ac(Variants.FULL_ACTIVATION_CHECKPOINTING, "transformer.h", gpt(), Config.FullACParams())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Applying activation checkpointing to 4 layers..."
    assert lines[1:] == [f"Applying activation checkpointing to {i}..." for i in range(4)]


def test_fsdp1_path_rejects_models_that_are_not_fsdp1():
    with pytest.raises(ValueError, match="can only be applied to FSDP1 wrapped models"):
        apply_activation_checkpointing_fsdp1_inplace(gpt(), ["Block"])
    with pytest.raises(ValueError, match="can only be applied to FSDP1 wrapped models"):
        apply_activation_checkpointing_fsdp1_inplace(gpt(), ["GPT2Block"])  # upstream checks the model first
    assert is_module_to_apply_activation_checkpointing(Block(), [Block])
    assert not is_module_to_apply_activation_checkpointing(nn.Linear(1, 1), [Block])


def test_fsdp1_path_wraps_named_block_classes_with_exact_gradients():
    # FSDP1 needs a process group (process-wide state): a one-rank gloo group in a fresh process.
    script = textwrap.dedent("""
        import os, tempfile, warnings
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing import (
            apply_activation_checkpointing_fsdp1_inplace)
        from acshim.testing import assert_bitwise_equal, tiny_sequential, train_step
        warnings.simplefilter("ignore")
        handle, path = tempfile.mkstemp()
        os.close(handle)
        try:
            dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
            def build():
                torch.manual_seed(0)
                return FSDP(tiny_sequential(depth=2, width=16), device_id=torch.device("cpu"), use_orig_params=True)
            inputs = torch.randn(2, 4, 16)
            expected = train_step(build(), inputs)
            model = build()
            try:
                apply_activation_checkpointing_fsdp1_inplace(model, ["GPT2Block"])
                raise AssertionError("unknown class accepted")
            except ValueError as error:
                assert "no module of class 'GPT2Block'" in str(error), error
            apply_activation_checkpointing_fsdp1_inplace(model, ["MLPBlock"])
            names = [n for n, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"]
            assert names == ["_fsdp_wrapped_module.0", "_fsdp_wrapped_module.1"], names
            actual = train_step(model, inputs)
            assert_bitwise_equal(expected, {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in actual.items()})
            print("FSDP1 OK")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            os.remove(path)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FSDP1 OK" in result.stdout


def test_acshim_patches_point_at_the_facade_staticmethod():
    import pkgutil

    entries = dict(((module, attribute), path) for module, attribute, path in modalities_root.ACSHIM_PATCHES)
    key = ("modalities.training.activation_checkpointing.activation_checkpointing",
           "ActivationCheckpointing.apply_activation_checkpointing_")
    descriptor = pkgutil.resolve_name(entries[key])
    assert isinstance(descriptor, staticmethod)
    assert descriptor is ActivationCheckpointing.__dict__["apply_activation_checkpointing_"]
    fsdp1_key = ("modalities.training.activation_checkpointing.activation_checkpointing",
                 "apply_activation_checkpointing_fsdp1_inplace")
    assert pkgutil.resolve_name(entries[fsdp1_key]) is apply_activation_checkpointing_fsdp1_inplace

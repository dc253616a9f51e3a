"""The Modalities facade against the real Modalities 0.5.

The real package needs transformers < 5, so it is installed only in CI's second environment (the
transformers 4.x one, see README); elsewhere this module is skipped as "absent upstream".

Parity: each variant (full, selective layer with ``ac_freq``, selective op with ``save_ops_keys``)
applied by the facade and by the real ``ActivationCheckpointing`` to the same Modalities
``GPT2LLM`` wraps the same layers under the same names and, with dropout off, gives bitwise-equal
outputs and gradients. With dropout on the facade still equals the run without checkpointing while
the real package does not: it wraps with ``preserve_rng_state=False``, so the recompute draws other
dropout masks.

Upstream's own tests: Modalities' ``tests/training/test_activation_checkpointing.py`` is not in the
PyPI sdist and CI cannot reach GitHub, so it is not run here. The tests at the end check what it
checks (read at v0.5.0), with acshim installed over the real package (``acshim.install``, patch
mode) and models built by Modalities' own config system (``Main.build_components`` on a YAML
config): which modules become ``CheckpointWrapper`` for each variant, and losses and gradients of the
three variants equal to the raw model (upstream's end-to-end test needs CUDA; here it runs on CPU,
and bitwise rather than within a tolerance). Its three FSDP tests need 2 GPUs; the facade's FSDP1
path is tested on a one-rank gloo group in test_modalities.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from acshim.patching.dialects import module_exists

if not module_exists("modalities"):
    pytest.skip("absent upstream: the real Modalities is not installed here (it needs transformers < 5; "
                "CI installs it in the transformers 4.x environment)", allow_module_level=True)

import torch
import torch.nn.functional as F
from modalities.config.config import ActivationCheckpointedModelConfig as RealConfig
from modalities.config.pydantic_if_types import PydanticPytorchModuleType
from modalities.main import Main
from modalities.models.gpt2.gpt2_model import GPT2LLMConfig
from modalities.models.model_factory import GPT2ModelFactory
from modalities.training.activation_checkpointing.activation_checkpointing import (
    ActivationCheckpointing as RealAC,
)
from modalities.training.activation_checkpointing.activation_checkpointing_variants import (
    ActivationCheckpointingVariants as RealVariants,
)
from pydantic import BaseModel
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as torch_checkpoint_wrapper,
)

import acshim
from acshim.facades.modalities.config.config import ActivationCheckpointedModelConfig as FacadeConfig
from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing import (
    ActivationCheckpointing as FacadeAC,
)
from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing_variants import (
    ActivationCheckpointingVariants as FacadeVariants,
)
from acshim.testing import assert_bitwise_equal, train_step

WIDTH, VOCAB, LENGTH = 128, 128, 16  # Modalities' GPT2LLMConfig wants multiples of 128
NORM = {"norm_type": "rms_norm", "config": {"ndim": WIDTH, "bias": True, "epsilon": 1e-5}}
MODEL = {
    "sample_key": "input_ids", "prediction_key": "logits", "poe_type": "NOPE", "sequence_length": LENGTH,
    "vocab_size": VOCAB, "n_layer": 4, "n_head_q": 4, "n_head_kv": 4, "ffn_hidden": 4 * WIDTH, "n_embd": WIDTH,
    "dropout": 0.0, "bias": True, "attention_implementation": "manual", "activation_type": "gelu",
    "attention_config": {"qkv_transforms": [{"type_hint": "RotaryTransform", "config": {
        "n_embd": WIDTH, "n_head": 4, "seq_length_dim": -2, "base_freq": 10000}}]},
    "attention_norm_config": NORM, "ffn_norm_config": NORM, "lm_head_norm_config": NORM,
    "use_weight_tying": True, "use_meta_device": False,
}

# variant -> (facade variant and parameters, real variant and parameters, layers wrapped)
VARIANTS = {
    "full": (FacadeVariants.FULL_ACTIVATION_CHECKPOINTING, FacadeConfig.FullACParams(),
             RealVariants.FULL_ACTIVATION_CHECKPOINTING, RealConfig.FullACParams(), ["0", "1", "2", "3"]),
    "selective_layer": (FacadeVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING,
                        FacadeConfig.SelectiveLayerACParams(ac_freq=2),
                        RealVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING,
                        RealConfig.SelectiveLayerACParams(ac_freq=2), ["1", "3"]),
    "selective_op": (FacadeVariants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
                     FacadeConfig.SelectiveOpACParams(save_ops_keys=["ops.aten.mm.default"]),
                     RealVariants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
                     RealConfig.SelectiveOpACParams(save_ops_keys=["ops.aten.mm.default"]), ["0", "1", "2", "3"]),
}


def gpt2(dropout: float = 0.0, seed: int = 42) -> nn.Module:
    """Modalities' own GPT2LLM, built by its model factory from a validated config."""
    config = GPT2LLMConfig.model_validate(dict(MODEL, dropout=dropout))
    torch.manual_seed(seed)
    return GPT2ModelFactory.get_gpt2_model(**dict(config))


def token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LENGTH + 1), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training step (dropout masks drawn from seed 1), keyed without wrapper prefixes."""
    state = train_step(model, ({"input_ids": ids[:, :-1]},),  # a tuple: Modalities takes one dict
                       loss_fn=lambda out: F.cross_entropy(out["logits"].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))
    return {key.replace("_checkpoint_wrapped_module.", ""): value for key, value in state.items()}


def wrapped_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]


@pytest.fixture(autouse=True)
def real_modalities_unpatched(capsys):
    """The real entry point is upstream's own here (no acshim.install() left over), and the
    selective-layer counter upstream keeps on torch's checkpoint_wrapper starts at zero."""
    assert RealAC.__dict__["apply_activation_checkpointing_"].__func__.__module__.startswith("modalities.")
    torch_checkpoint_wrapper.__dict__.pop("_count", None)
    yield  # capsys: both print a progress line per layer
    torch_checkpoint_wrapper.__dict__.pop("_count", None)


def apply_real(name: str, model: nn.Module) -> nn.Module:
    _, _, variant, params, _ = VARIANTS[name]
    torch_checkpoint_wrapper.__dict__.pop("_count", None)
    RealAC.apply_activation_checkpointing_(variant, "transformer.h", model, params)
    return model


def apply_facade(name: str, model: nn.Module) -> nn.Module:
    variant, params, _, _, _ = VARIANTS[name]
    FacadeAC.apply_activation_checkpointing_(variant, "transformer.h", model, params)
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_facade_equals_real_modalities_without_dropout(name):
    ids = token_ids()
    real, facade = apply_real(name, gpt2()), apply_facade(name, gpt2())
    layers = [f"transformer.h.{i}" for i in VARIANTS[name][4]]
    assert wrapped_names(real) == wrapped_names(facade) == layers
    assert list(real.state_dict()) == list(facade.state_dict())
    with torch.no_grad():
        inputs = {"input_ids": ids[:, :-1]}
        assert torch.equal(real(inputs)["logits"], facade(inputs)["logits"])
    expected = step(real, ids)
    assert_bitwise_equal(expected, step(facade, ids))
    assert_bitwise_equal(expected, step(gpt2(), ids))  # and both equal the raw model


@pytest.mark.parametrize("name", VARIANTS)
def test_with_dropout_facade_equals_no_checkpointing_and_real_modalities_does_not(name):
    ids = token_ids()
    expected = step(gpt2(dropout=0.1), ids)
    real = apply_real(name, gpt2(dropout=0.1))
    # Upstream's reason: every wrapper it builds passes preserve_rng_state=False to the checkpoint.
    wrappers = [m for m in real.modules() if isinstance(m, CheckpointWrapper)]
    assert wrappers and all(m.checkpoint_fn.keywords["preserve_rng_state"] is False for m in wrappers)
    upstream = step(real, ids)
    assert torch.equal(upstream["loss"], expected["loss"])  # the forward draws the same masks...
    differing = [key for key in expected if key.startswith("grad:") and not torch.equal(expected[key], upstream[key])]
    assert differing, "real Modalities matched the run without checkpointing"  # ...the recompute does not
    assert_bitwise_equal(expected, step(apply_facade(name, gpt2(dropout=0.1)), ids))


def test_real_selective_layer_counter_leaks_between_models_and_the_facade_does_not():
    wrapped = {"real": [], "facade": []}
    for _ in range(2):
        model = gpt2()
        RealAC.apply_activation_checkpointing_(RealVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING,
                                               "transformer.h", model, RealConfig.SelectiveLayerACParams(ac_freq=3))
        wrapped["real"].append(wrapped_names(model))
        model = gpt2()
        FacadeAC.apply_activation_checkpointing_(FacadeVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING,
                                                 "transformer.h", model, FacadeConfig.SelectiveLayerACParams(ac_freq=3))
        wrapped["facade"].append(wrapped_names(model))
    assert wrapped["real"] == [["transformer.h.2"], ["transformer.h.1"]]  # the count went on: 5, 6, 7, 8
    assert wrapped["facade"] == [["transformer.h.2"], ["transformer.h.2"]]


# What Modalities' tests/training/test_activation_checkpointing.py checks, with acshim installed over
# the real package and the models built by Modalities' config system.

def _config_yaml() -> str:
    import yaml

    raw = {"component_key": "model", "variant_key": "gpt2", "config": MODEL}
    components = {"model_raw": raw}
    for name, (_, _, variant, params, _) in VARIANTS.items():
        components[f"{name}_model"] = {
            "component_key": "model", "variant_key": "activation_checkpointed",
            "config": {"ac_variant": variant.value, "model": {"instance_key": "model_raw", "pass_type": "BY_REFERENCE"},
                       "layers_fqn": "transformer.h", "ac_fun_params": params.model_dump()}}
    return yaml.safe_dump(components, sort_keys=False)


class RawModel(BaseModel):
    model_raw: PydanticPytorchModuleType


class FullModel(BaseModel):
    full_model: PydanticPytorchModuleType


class SelectiveLayerModel(BaseModel):
    selective_layer_model: PydanticPytorchModuleType


class SelectiveOpModel(BaseModel):
    selective_op_model: PydanticPytorchModuleType


COMPONENT_MODELS = {"full": FullModel, "selective_layer": SelectiveLayerModel, "selective_op": SelectiveOpModel}


@pytest.fixture
def modalities_main(tmp_path: Path):
    """Modalities' Main on our config, with acshim installed over the real package (patch mode)."""
    config = tmp_path / "config_activation_checkpointing.yaml"
    config.write_text(_config_yaml())
    acshim.install(dialects=["modalities"], transformers=False)
    try:
        yield Main(config, experiment_id="-1", experiments_root_path=tmp_path)
    finally:
        acshim.uninstall()


def build(main: Main, name: str) -> nn.Module:
    torch.manual_seed(42)
    if name == "raw":
        return main.build_components(components_model_type=RawModel).model_raw
    return getattr(main.build_components(components_model_type=COMPONENT_MODELS[name]), f"{name}_model")


@pytest.mark.parametrize("name", VARIANTS)
def test_modalities_config_checkpoints_the_upstream_layers_on_the_facade(name, modalities_main):
    """Upstream's test_fsdp2_{full,selective_layer,selective_op}_activation_checkpointing."""
    for _ in range(2):  # a second build wraps the same layers (upstream's counter would go on)
        model = build(modalities_main, name)
        layers = [f"transformer.h.{i}" for i in VARIANTS[name][4]]
        assert wrapped_names(model) == layers
        wrappers = [module for module in model.modules() if isinstance(module, CheckpointWrapper)]
        assert all(type(module).__module__.startswith("acshim.facades.") for module in wrappers), "not the facade"


def test_modalities_config_variants_give_the_raw_model_losses_and_gradients(modalities_main):
    """Upstream's test_fsdp2_activation_checkpointing_end2end (CUDA there; CPU and bitwise here)."""
    ids = token_ids()
    models = {name: build(modalities_main, name) for name in ("raw", *VARIANTS)}
    assert len({id(model) for model in models.values()}) == len(models)
    expected = step(models.pop("raw"), ids)
    for name, model in models.items():
        assert wrapped_names(model), name
        assert_bitwise_equal(expected, step(model, ids))


def test_report_names_the_regions_modalities_built(modalities_main):
    """``acshim run --report`` names the regions of the wrappers Modalities' config built
    ``modalities`` (the facade says so), not ``torch checkpoint_wrapper``."""
    from acshim import report

    model = build(modalities_main, "full")
    recorder = report.start()
    try:
        step(model, token_ids())
        rendered = recorder.render()
    finally:
        report.stop()
    per_dialect = rendered.split("acshim report: per dialect", 1)[1].split("acshim report:", 1)[0]
    assert re.findall(r"^  (.+?)\s+4 region\(s\), 4 forwards, 4 recomputes", per_dialect, re.M) == ["modalities"], \
        rendered

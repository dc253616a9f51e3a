"""Under acshim.hf.install(), transformers' own switches are carried out by the engine.

Runs on transformers 4.x and 5.x (CI runs both majors). Where a name used here exists only in 5.x
(``activation_checkpointing_enable`` / ``_disable``, ``is_activation_checkpointing``, upstream's
``offload``), the 4.x spelling is tested instead (``gradient_checkpointing_enable(every_n_layers=...,
offload=...)``, which acshim accepts on 4.x too), and a case that exercises the 5.x name itself is
skipped on 4.x with a reason starting "absent upstream:" (see tests/conftest.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel

import acshim.hf as hf
from acshim.hf.region import EngineCheckpointFunction
from acshim.measure import measure_memory
from acshim.testing import assert_bitwise_equal, hf_inputs, hf_model, train_step

MAJOR = int(transformers.__version__.split(".")[0])
# A ViT layer's first query weight: transformers 5 renamed the encoder and its attention projections.
VIT_QUERY = ("vit.layers.0.attention.q_proj.weight" if MAJOR >= 5
             else "vit.encoder.layer.0.attention.attention.query.weight")
ENTRIES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
DISABLES = ("activation_checkpointing_disable", "gradient_checkpointing_disable")

NAMES = ("gradient_checkpointing_enable", "gradient_checkpointing_disable",
         "activation_checkpointing_enable", "activation_checkpointing_disable", "post_init")


def needs_upstream(name: str) -> pytest.MarkDecorator:
    """Skip where the installed transformers has no ``PreTrainedModel.<name>`` (5.x-only names)."""
    return pytest.mark.skipif(not hasattr(PreTrainedModel, name),
                              reason=f"absent upstream: transformers {transformers.__version__} has no "
                                     f"PreTrainedModel.{name}")


def entry_params(names: tuple[str, ...]) -> list:
    return [pytest.param(name, marks=needs_upstream(name)) for name in names]


def _engine_functions(model):
    return {type(m._gradient_checkpointing_func) for m in model.modules() if hasattr(m, "gradient_checkpointing")}


def test_uninstall_restores_every_method_exactly():
    before = {name: vars(PreTrainedModel).get(name) for name in NAMES}
    hf.install()
    hf.patch_transformers()
    assert vars(PreTrainedModel)["gradient_checkpointing_enable"] is not before["gradient_checkpointing_enable"]
    hf.unpatch_transformers()
    assert vars(PreTrainedModel)["gradient_checkpointing_enable"] is not before["gradient_checkpointing_enable"]
    hf.uninstall()
    assert {name: vars(PreTrainedModel).get(name) for name in NAMES} == before


@pytest.mark.parametrize(("arch", "kwargs"), [("gpt2", None), ("gpt2", {"use_reentrant": True}),
                                             ("bert", {"use_reentrant": False}), ("vit", None)])
def test_gradient_checkpointing_enable_runs_the_engine_exactly(arch, kwargs, installed):
    expected = train_step(hf_model(arch), hf_inputs(arch))
    model = hf_model(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert _engine_functions(model) == {EngineCheckpointFunction}
    assert model.is_gradient_checkpointing
    reentrant = kwargs["use_reentrant"] if kwargs else MAJOR < 5  # upstream's default: reentrant before 5.0
    assert model.transformer.h[0]._gradient_checkpointing_func.options.reentrant is reentrant if arch == "gpt2" else True
    assert_bitwise_equal(expected, train_step(model, hf_inputs(arch)))
    assert measure_memory(model, hf_inputs(arch)).held_bytes < 0.5 * measure_memory(hf_model(arch), hf_inputs(arch)).held_bytes


@needs_upstream("is_activation_checkpointing")
def test_is_activation_checkpointing_follows_enable_and_disable(installed):
    model = hf_model("gpt2")
    assert not model.is_activation_checkpointing
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing and model.is_gradient_checkpointing
    assert _engine_functions(model) == {EngineCheckpointFunction}
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing and not model.is_gradient_checkpointing


@pytest.mark.parametrize("entry", entry_params(ENTRIES))
@pytest.mark.parametrize("disable", entry_params(DISABLES))
def test_disable_turns_everything_off(entry, disable, installed):
    model = hf_model("llama")
    getattr(model, entry)(every_n_layers=2)
    assert hf.settings_of(model).every_n_layers == 2
    getattr(model, disable)()
    assert not model.is_gradient_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert hf.settings_of(model) is None


@pytest.mark.parametrize("entry", entry_params(ENTRIES))
def test_every_n_layers_flags_blocks_0_and_2(entry, installed):
    """On 4.x (no such argument upstream) acshim accepts ``gradient_checkpointing_enable(every_n_layers=2)``."""
    model = hf_model("llama", num_hidden_layers=4)
    getattr(model, entry)(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    expected = train_step(hf_model("llama", num_hidden_layers=4), hf_inputs("llama"))
    assert_bitwise_equal(expected, train_step(model, hf_inputs("llama")))


def test_every_n_layers_inside_kwargs_is_honoured(installed):
    model = hf_model("gpt2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": True})
    assert [block.gradient_checkpointing for block in model.transformer.h] == [True, False, True]
    assert model.transformer.h[0]._gradient_checkpointing_func.options.reentrant


@pytest.mark.parametrize("entry", entry_params(ENTRIES))
def test_offload_true_never_fails_on_cpu(entry, installed):
    storage = pytest.importorskip("acshim.storage")
    expected = train_step(hf_model("llama"), hf_inputs("llama"))
    model = hf_model("llama")
    with storage.recording() as sessions:
        getattr(model, entry)(offload=True)
        actual = train_step(model, hf_inputs("llama"))
    assert hf.settings_of(model).offload
    scope = model.model.layers[0]._gradient_checkpointing_func.options.saved_tensors_scope
    assert isinstance(scope, storage.BoundaryOffload)
    assert len(sessions) == 1 and sessions[0].stats.saved > 0, "the regions' inputs went through the storage tier"
    assert_bitwise_equal(expected, actual)


@needs_upstream("activation_checkpointing_enable")
def test_upstream_offload_fails_on_cpu_only_machines():
    """The reason acshim routes offload itself: upstream pins host memory, which needs an accelerator."""
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    model = hf_model("llama")
    model.activation_checkpointing_enable(offload=True)
    with pytest.raises(RuntimeError):
        train_step(model, hf_inputs("llama"))


def test_trainer_default_call_keeps_kwargs_set_on_the_model(installed):
    """transformers#26221: Trainer re-enabling with defaults must not reset the user's use_reentrant."""
    model = hf_model("gpt2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2})
    if MAJOR >= 5:  # what Trainer calls
        model.activation_checkpointing_enable(None, every_n_layers=1, offload=False)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)
    settings = hf.settings_of(model)
    assert settings.kwargs == {"use_reentrant": False} and settings.every_n_layers == 2
    assert not model.transformer.h[0]._gradient_checkpointing_func.options.reentrant
    getattr(model, ENTRIES[0] if MAJOR >= 5 else ENTRIES[1])({"use_reentrant": True})  # an explicit call still wins
    assert model.transformer.h[0]._gradient_checkpointing_func.options.reentrant


def test_unknown_checkpoint_kwarg_is_an_error_at_enable_time(installed):
    model = hf_model("gpt2")
    with pytest.raises(TypeError, match="gradient_checkpointing_kwargs: unknown checkpointing option"):
        model.gradient_checkpointing_enable({"use_reentrnt": False})
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        model.gradient_checkpointing_enable({"use_reentrant": True, "debug": True})


def test_enable_replaces_autopatch_regions_instead_of_nesting(installed, autopatched):
    model = autopatched(lambda: hf_model("gpt2"))
    assert hf.acshim_regions(model)
    model.gradient_checkpointing_enable()
    assert not hf.acshim_regions(model)
    assert _engine_functions(model) == {EngineCheckpointFunction}


@pytest.mark.parametrize("reentrant", [False, True])
def test_frozen_embeddings_train_without_input_require_grads(reentrant, installed):
    """ViT (main_input_name pixel_values): upstream adds no input-grad hook; with a frozen patch
    embedding, torch's reentrant checkpoint would give the layers no gradients at all."""
    def frozen():
        model = hf_model("vit")
        model.vit.embeddings.requires_grad_(False)
        return model

    expected = train_step(frozen(), hf_inputs("vit"))
    model = frozen()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    assert not getattr(model, "_require_grads_hooks", None)
    actual = train_step(model, hf_inputs("vit"))
    assert f"grad:{VIT_QUERY}" in actual
    assert_bitwise_equal(expected, actual)


def test_lora_style_frozen_base_with_hook_removed_trains(installed):
    def lora_like():
        model = hf_model("llama")
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.requires_grad_(True)
        return model

    expected = train_step(lora_like(), hf_inputs("llama"))
    model = lora_like()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    if MAJOR >= 5:  # 5.x adds the input-grad hook for input_ids models; 4.x adds none (and its
        model.disable_input_require_grads()  # disable_input_require_grads fails without one)
    assert not getattr(model, "_require_grads_hooks", None) and not hasattr(model, "_require_grads_hook")
    actual = train_step(model, hf_inputs("llama"))
    assert len([k for k in actual if k.startswith("grad:")]) == 3
    assert_bitwise_equal(expected, actual)


class _KwLayer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, scale=1.0):
        return torch.tanh(self.linear(hidden_states)) * scale


def test_hidden_states_passed_by_keyword_get_gradients_in_reentrant_mode():
    torch.manual_seed(0)
    layer = _KwLayer()
    x = torch.randn(2, 8, requires_grad=True)
    layer(hidden_states=x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    with pytest.raises(RuntimeError, match="does not require grad"):  # upstream drops keyword tensors
        layer(hidden_states=x).sum().backward()
    layer._gradient_checkpointing_func = EngineCheckpointFunction(hf.region.options_from_checkpoint_kwargs(
        {"use_reentrant": True}, False))
    layer(hidden_states=x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_model_upstream_refuses_is_checkpointed_in_place(installed):
    from tests.hf.test_autopatch import _NoGCConfig, _NoGCModel

    torch.manual_seed(0)
    plain = _NoGCModel(_NoGCConfig())
    torch.manual_seed(0)
    model = _NoGCModel(_NoGCConfig())
    model.gradient_checkpointing_enable()
    assert hf.acshim_regions(model) == ["layers.0", "layers.1", "layers.2"]
    assert model.is_gradient_checkpointing
    x = torch.randn(2, 16)
    assert_bitwise_equal(train_step(plain, x), train_step(model, x))
    model.gradient_checkpointing_disable()
    assert not hf.acshim_regions(model) and not model.is_gradient_checkpointing


def test_legacy_config_flag_is_carried_out_by_the_engine(installed):
    config = hf_model("gpt2").config
    config.gradient_checkpointing = True
    model = transformers.GPT2LMHeadModel(config)
    assert _engine_functions(model) == {EngineCheckpointFunction}

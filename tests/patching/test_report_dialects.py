"""``acshim run --report`` names the API that made each region because its facade says so
(``RegionOptions.dialect``, ``acshim.region_dialect.made_by``), not from the call stack: a tiny model
checkpointed through each facade and route, one step under the report, and the per-dialect table
(the offload table for the offload-only APIs) names that API. Libraries that build torch's
``checkpoint_wrapper`` for their users (Modalities, torchtitan, Lightning) are named, not ``torch``."""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import acshim
from acshim import report

Step = Callable[[], torch.Tensor]
"""One forward of the checkpointed model, its loss."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class Layered(nn.Module):
    """Blocks at ``layers`` (a ModuleDict, as Modalities and torchtitan keep them)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def _x() -> torch.Tensor:
    return torch.randn(4, 16, requires_grad=True)


def _loss_of(model: nn.Module) -> Step:
    return lambda: model(_x()).square().mean()


def _acshim_checkpoint() -> Step:
    block = Block()
    return lambda: acshim.checkpoint(block, _x()).sum()


def _acshim_apply() -> Step:
    model = Layered()
    acshim.apply_checkpointing(model, "layers.*")
    return _loss_of(model)


def _deepspeed() -> Step:
    from acshim.facades.deepspeed.runtime.activation_checkpointing import checkpointing

    block = Block()
    return lambda: checkpointing.checkpoint(block, _x()).sum()


def _fairscale() -> Step:
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    return _loss_of(checkpoint_wrapper(Block()))


def _smp_v1() -> Step:
    import acshim.facades.smdistributed.modelparallel.torch as smp

    block = Block()
    return lambda: smp.checkpoint(block, _x()).sum()


def _torch_wrapper_facade() -> Step:
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return _loss_of(checkpoint_wrapper(Block()))


def _smp_v2() -> Step:
    """SMP v2 has no checkpointing API of its own: its scripts use torch's, and are named so."""
    import acshim.facades.torch.sagemaker as tsm
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    tsm.init()
    model = tsm.transform(Layered())
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    return _loss_of(model)


def _modalities() -> Step:
    from acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing import (
        ActivationCheckpointing,
        ActivationCheckpointingVariants,
    )

    model = Layered()
    ActivationCheckpointing.apply_activation_checkpointing_(
        ActivationCheckpointingVariants.FULL_ACTIVATION_CHECKPOINTING, "layers", model, types.SimpleNamespace())
    return _loss_of(model)


def _megatron() -> Step:
    from acshim.facades.megatron.core.tensor_parallel.random import checkpoint

    block = Block()
    return lambda: checkpoint(block, False, _x()).sum()


def _hugging_face() -> Step:
    from acshim.hf.region import EngineCheckpointFunction
    from acshim.options import RegionOptions

    block, function = Block(), EngineCheckpointFunction(RegionOptions())  # what gradient_checkpointing_enable sets
    return lambda: function(block, _x()).sum()


def _torch_route() -> Step:
    from acshim.patching.torch_route import route_torch_checkpoint

    assert route_torch_checkpoint()  # what acshim run --report does
    block = Block()
    return lambda: torch.utils.checkpoint.checkpoint(block, _x(), use_reentrant=False).sum()


def _lightning() -> Step:
    pytest.importorskip("lightning", reason="absent upstream: lightning is not installed (pip install 'acshim[lightning]')")
    from lightning.fabric.strategies import FSDPStrategy
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

    acshim.install(dialects=["torch"], transformers=False)
    model = Layered()
    _setup_activation_checkpointing(model, FSDPStrategy(activation_checkpointing_policy={Block})
                                    ._activation_checkpointing_kwargs)
    return _loss_of(model)


def _torchtitan() -> Step:
    titan = pytest.importorskip("torchtitan.distributed.activation_checkpoint",
                                reason="absent upstream: torchtitan is not installed (docs/torchtitan.md)")
    acshim.install(dialects=["torch", "torchtitan"], transformers=False)
    model = Layered()
    titan.FullAC.Config().build().apply(model)
    return _loss_of(model)


def _torchtune() -> Step:
    from acshim.facades.torchtune import training

    model = Layered()
    manager = training.OffloadActivations(min_offload_size=0, use_pin_memory=False, use_streams=False)

    def step() -> torch.Tensor:
        with manager:
            return model(_x()).square().mean()

    return step


def _trl() -> Step:
    from acshim.facades.trl.models import activation_offloading

    model = Layered()
    manager = activation_offloading.OffloadActivations(min_offload_size=0, use_pin_memory=False, use_streams=False)

    def step() -> torch.Tensor:
        with manager:
            return model(_x()).square().mean()

    return step


REGIONS = {
    "acshim.checkpoint": (_acshim_checkpoint, "acshim"),
    "acshim.apply_checkpointing": (_acshim_apply, "acshim"),
    "deepspeed": (_deepspeed, "deepspeed"),
    "fairscale": (_fairscale, "fairscale"),
    "smp v1": (_smp_v1, "smdistributed"),
    "smp v2": (_smp_v2, "torch checkpoint_wrapper"),
    "torch checkpoint_wrapper": (_torch_wrapper_facade, "torch checkpoint_wrapper"),
    "modalities": (_modalities, "modalities"),
    "megatron": (_megatron, "megatron"),
    "hugging face": (_hugging_face, "hf"),
    "torch.utils.checkpoint routed": (_torch_route, "torch.utils.checkpoint"),
    "lightning": (_lightning, "lightning FSDPStrategy"),
    "torchtitan": (_torchtitan, "torchtitan"),
}
OFFLOADS = {"torchtune": (_torchtune, "torchtune"), "trl": (_trl, "trl")}


@pytest.fixture
def reported() -> Iterator[Callable[[Step], str]]:
    """Runs a step (forward and backward) under the report; gives back what the report printed."""
    from acshim.patching.torch_route import unroute_torch_checkpoint

    acshim.uninstall()
    try:
        def run(step: Step) -> str:
            recorder = report.start()
            step().backward()
            return recorder.render()

        yield run
    finally:
        report.stop()
        unroute_torch_checkpoint()
        acshim.uninstall()


def _section(rendered: str, title: str) -> str:
    return rendered.split(f"acshim report: {title}", 1)[1].split("acshim report:", 1)[0]


@pytest.mark.parametrize(("build", "dialect"), REGIONS.values(), ids=REGIONS.keys())
def test_per_dialect_table_names_the_api_that_made_the_regions(reported: Callable[[Step], str],
                                                               build: Callable[[], Step], dialect: str) -> None:
    torch.manual_seed(0)
    rendered = reported(build())
    named = re.findall(r"^  (.+?)\s+\d+ region\(s\), \d+ forwards, [1-9]\d* recomputes",
                       _section(rendered, "per dialect"), re.M)
    assert named == [dialect], rendered


@pytest.mark.parametrize(("build", "origin"), OFFLOADS.values(), ids=OFFLOADS.keys())
def test_offload_table_names_the_offload_only_apis(reported: Callable[[Step], str], build: Callable[[], Step],
                                                   origin: str) -> None:
    torch.manual_seed(0)
    rendered = reported(build())
    assert re.search(rf"moved, .* by {re.escape(origin)}$", _section(rendered, "offloaded"), re.M), rendered
    assert "(no region ran)" in rendered


def test_a_region_inside_a_facades_region_is_named_by_its_own_caller(reported: Callable[[Step], str]) -> None:
    """The name a facade gives its ``acshim.checkpoint`` call does not leak into the regions its
    block makes itself."""
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return acshim.checkpoint(self.inner, x)

    model = checkpoint_wrapper(Outer())
    rendered = reported(functools.partial(_loss_of(model)))
    named = re.findall(r"^  (.+?)\s+\d+ region\(s\)", _section(rendered, "per dialect"), re.M)
    assert sorted(named) == ["acshim", "torch checkpoint_wrapper"], rendered

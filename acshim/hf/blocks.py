"""Find a Hugging Face model's repeated blocks without per-architecture tables.

Order of evidence: instances of transformers' ``GradientCheckpointingLayer`` (4.5x and 5.x mark
every decoder/encoder block with it), else the classes named in ``_no_split_modules`` (what
Accelerate's FSDP auto-wrap uses; only names with at least two instances count, so BERT's
``BertEmbeddings`` is left alone), else the engine's ``find_blocks`` (largest set of identical
blocks).
"""

from __future__ import annotations

from torch import nn

from ..blocks import find_blocks
from ..policy import ModuleTarget, Policy, Target


def gradient_checkpointing_layer_class() -> type | None:
    """``transformers.modeling_layers.GradientCheckpointingLayer``, or None where it does not exist."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def no_split_class_names(model: nn.Module) -> set[str]:
    """Union of ``_no_split_modules`` over ``model`` and its nested pretrained submodels."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            names.update(declared)
    return names


def hf_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the model's repeated blocks, outermost first, model order."""
    layer_class = gradient_checkpointing_layer_class()
    if layer_class is not None:
        found: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if module is model or not isinstance(module, layer_class):
                continue
            if any(name.startswith(outer + ".") for outer, _ in found):
                continue
            found.append((name, module))
        if found:
            return found
    names = no_split_class_names(model)
    if names:
        matches = find_blocks(model, names)
        counts: dict[type, int] = {}
        for _, module in matches:
            counts[type(module)] = counts.get(type(module), 0) + 1
        repeated = [(n, m) for n, m in matches if counts[type(m)] >= 2]
        if repeated:
            return repeated
    return find_blocks(model)


class HFBlocks(Policy):
    """Policy: the repeated blocks ``hf_blocks`` finds."""

    def select(self, model: nn.Module) -> list[Target]:
        return [ModuleTarget(name, module) for name, module in hf_blocks(model)]

    def __repr__(self) -> str:
        return "HFBlocks()"

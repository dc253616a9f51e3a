"""Random operators inside a selective-checkpoint region are recomputed, never replayed from the cache.

A recompute restores the RNG state the region started with and draws again, in the forward's order,
for every random operator it runs. An operator whose output a selective policy saved is not run in
the recompute, so it draws nothing there: every random operator after it then draws what that one
drew in the forward, and the recomputed dropout masks are not the forward's. Torch's own selective
checkpointing (torch/utils/checkpoint.py, ``_CachingTorchDispatchMode``) has the same trap. It is
met where saving the usual "expensive" operators includes a fused attention with dropout
(``aten._scaled_dot_product_efficient_attention`` / ``_flash_attention`` / ``_cudnn_attention`` on a
GPU draw their dropout inside the kernel): HF GPT-2 with attention dropout, planned "selective" on an
H200, gave gradients off by up to 0.015 in 146 of 148 parameters. On a CPU, attention with dropout
runs as separate operators (``bernoulli_`` then ``bmm``), so the trap did not show there.

``recompute_random_ops(policy)`` answers "recompute" for every operator that draws from the default
generators (tagged ``nondeterministic_seeded`` and not told to draw none: ``dropout_p=0``, ``p=0`` or
``train=False``), whatever ``policy`` said; every such operator then runs again in the recompute, in
order, from the restored state, and draws what it drew in the forward. An operator given its own
``generator=`` is left to the policy: its draws shift no other operator's, and the recompute does not
restore that generator, so replaying its saved output is what stays exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE, False)


@functools.cache
def _random_arguments(op: Any) -> tuple[bool, dict[str, int]] | None:
    """``(tagged, positions of the arguments that can turn drawing off)`` of a seeded operator;
    None for an operator that never draws."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return None
    schema = getattr(op, "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    return True, {name: index for index, name in enumerate(names) if name in ("dropout_p", "p", "train", "generator")}


def draws_random(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``op`` called with ``args``/``kwargs`` draws from the default random number generators."""
    found = _random_arguments(op)
    if found is None:
        return False
    values = {name: kwargs.get(name, args[index] if index < len(args) else None)
              for name, index in found[1].items()}
    if values.get("train") is False or values.get("generator") is not None:
        return False
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)) and not isinstance(values[name], bool):
            return values[name] > 0
    return True


def recompute_random_ops(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``policy`` with every operator that draws random numbers recomputed (see the module docstring)."""
    if getattr(policy, "_acshim_random_recomputed", False):
        return policy

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, op, *args, **kwargs)
        if decision not in _RECOMPUTE and draws_random(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return decision

    policy_fn._acshim_random_recomputed = True  # type: ignore[attr-defined]
    return policy_fn

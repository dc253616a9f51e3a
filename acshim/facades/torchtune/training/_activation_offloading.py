"""``torchtune.training._activation_offloading`` (torchtune 0.6) on acshim's storage tier.

Upstream's ``OffloadActivations`` is a ``saved_tensors_hooks`` that copies every saved tensor of at
least ``min_offload_size`` bytes to (pinned) CPU memory over a CUDA side stream and back in backward;
``NoOpManager`` opts a block out; ``get_act_offloading_ctx_manager`` is the recipes'
``enable_activation_offloading`` switch, which keeps the output head out of offloading. Here the
same names and arguments run on ``acshim.offload``: ``min_offload_size`` is its ``min_bytes``;
``use_pin_memory``/``use_streams`` are what its CUDA backend always does; ``max_fwd_stash_size``
(copies kept alive in forward) is validated as upstream, the backend bounding bytes in flight itself.
The tier is ``acshim.storage``'s default (host: device tensors to pinned memory, CPU tensors stay
put) unless ``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR`` say otherwise (``disk`` relieves
CPU training too).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

from torch import nn

from acshim.storage import no_offload
from acshim.storage.scopes import OffloadActivations as _EngineOffload

from ..._env import offload_storage

__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]


class OffloadActivations(_EngineOffload):
    """Context manager: activations saved for backward inside it leave memory for the storage tier
    and come back, prefetched and bitwise, in backward (torchtune's arguments; see the module)."""

    origin = "torchtune"

    def __init__(self, use_pin_memory: bool = True, use_streams: bool | None = None, max_fwd_stash_size: int = 5,
                 min_offload_size: int = 1024) -> None:
        self.use_streams = True if use_streams is None else use_streams
        if self.use_streams and max_fwd_stash_size < 1:
            raise ValueError(f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size}")
        self.use_pin_memory = use_pin_memory
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_tensor_size_bytes = min_offload_size
        storage, directory = offload_storage()
        super().__init__(storage=storage, directory=directory, min_bytes=min_offload_size)


class NoOpManager(no_offload):
    """Tensors saved inside this block stay where they are, even inside ``OffloadActivations``."""


def _heads(model: nn.Module) -> list[nn.Module]:
    # the same places torchtune looks: a wrapper's .module / .model, then .output (or a tied
    # linear's .linear), a Hugging Face .lm_head, or .decoder.output
    for attribute in ("module", "model"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            model = inner
    output = getattr(model, "output", None)
    if output is not None:
        if isinstance(output, nn.Module):
            return [output]
        linear = getattr(output, "linear", None)
        return [linear] if isinstance(linear, nn.Module) else []
    for head in (getattr(model, "lm_head", None), getattr(getattr(model, "decoder", None), "output", None)):
        if isinstance(head, nn.Module):
            return [head]
    return []


def _enter(opt_out: NoOpManager, *hook_args: Any) -> None:
    opt_out.__enter__()  # returns None: a forward pre-hook's result would replace the inputs


def _exit(opt_out: NoOpManager, *hook_args: Any) -> None:
    opt_out.__exit__(None, None, None)


def get_act_offloading_ctx_manager(model: nn.Module, enable_activation_offloading: bool,
                                   activation_offloading_use_streams: bool = True) -> Any:
    """``OffloadActivations`` for ``model`` with its output head kept out of offloading (brought
    back at once, its activations are not worth the trip), or a null context when disabled. Warns,
    as upstream, when no head is found."""
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    manager = OffloadActivations(use_streams=activation_offloading_use_streams)
    heads = _heads(model)
    for head in heads:
        opt_out = NoOpManager()
        head.register_forward_pre_hook(functools.partial(_enter, opt_out))
        head.register_forward_hook(functools.partial(_exit, opt_out), always_call=True)
    if not heads:
        warnings.warn("During activation offloading, no output head was detected. If your model has an output "
                      "head, it will be offloaded. This usually greatly slows training, given the large vocabulary "
                      "size. To change this behavior, set your output head as model.output and make it an "
                      "nn.Module.", stacklevel=2)
    return manager

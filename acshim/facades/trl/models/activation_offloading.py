"""``trl.models.activation_offloading`` (TRL 1.16) on acshim's storage tier.

Upstream's ``OffloadActivations`` (torchtune's design, ported) is a ``saved_tensors_hooks`` that
copies saved tensors of at least ``min_offload_size`` bytes from the accelerator to (pinned) CPU
memory and back in backward; on CPU it fails when built (it reads
``torch.accelerator.current_accelerator().type``). ``get_act_offloading_ctx_manager`` is what
``SFTConfig(activation_offloading=True)`` (and DPO, KTO, reward) calls: the manager, with the output
head and any Liger module kept out of offloading. Here the same names, arguments and
``ValueError`` run on ``acshim.offload``: ``min_offload_size`` is its ``min_bytes``;
``use_pin_memory``/``use_streams`` are what its CUDA backend always does; ``max_fwd_stash_size`` is
validated as upstream, the backend bounding bytes in flight itself; parameters are never moved
(upstream's ``update_model_params`` filter is the engine's own rule). The tier is ``acshim.storage``'s
default unless ``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR`` say otherwise (``disk`` relieves
CPU training too).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn

from acshim.storage import no_offload
from acshim.storage.scopes import OffloadActivations as _EngineOffload

from ..._env import offload_storage

__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]

logger = logging.getLogger("trl.models.activation_offloading")

NO_HEAD_WARNING = (
    "During activation offloading, no output head was detected. If your model has an output head, it will be "
    "offloaded. This usually greatly slows training, given the large vocabulary size. To change this "
    "behavior, set your output head as model.output and make it an nn.Module. You can disable this warning by "
    "passing `warn_if_no_head=False`.")
"""TRL 1.16's wording."""


class OffloadActivations(_EngineOffload):
    """Context manager: activations saved for backward inside it leave memory for the storage tier
    and come back, prefetched and bitwise, in backward (TRL's arguments; see the module).

    Raises:
        ValueError: ``use_streams`` with ``max_fwd_stash_size`` below 1, as upstream.
    """

    origin = "trl"

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_size: int = 1024,
                 max_fwd_stash_size: int = 5) -> None:
        self.use_streams = use_streams
        if use_streams and max_fwd_stash_size < 1:
            raise ValueError(f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size}")
        self.use_pin_memory = use_pin_memory
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_tensor_size_bytes = min_offload_size
        storage, directory = offload_storage()
        super().__init__(storage=storage, directory=directory, min_bytes=min_offload_size)

    def update_model_params(self, model: nn.Module) -> None:
        """Upstream records the parameters' storages so they are not offloaded; the engine never
        moves a parameter (``acshim.storage.residents``), so there is nothing to record."""


class NoOpManager(no_offload):
    """Tensors saved inside this block stay where they are, even inside ``OffloadActivations``."""


def _enter(opt_out: NoOpManager, *hook_args: Any) -> None:
    opt_out.__enter__()  # returns None: a forward pre-hook's result would replace the inputs


def _exit(opt_out: NoOpManager, *hook_args: Any) -> None:
    opt_out.__exit__(None, None, None)


def _opt_out(module: nn.Module) -> None:
    opt_out = NoOpManager()
    module.register_forward_pre_hook(functools.partial(_enter, opt_out))
    module.register_forward_hook(functools.partial(_exit, opt_out), always_call=True)


def _head(model: nn.Module) -> nn.Module | None:
    # upstream's search, in its order: .output (or its .linear), .lm_head, .decoder.output /
    # .decoder.lm_head, the final norm (.final_layer_norm / .ln_f), .head
    output = getattr(model, "output", None)
    if output is not None:
        if isinstance(output, nn.Module):
            return output
        linear = getattr(output, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(model, "lm_head"):
        return model.lm_head
    if hasattr(model, "decoder"):
        decoder = model.decoder
        for name in ("output", "lm_head"):
            if hasattr(decoder, name):
                return getattr(decoder, name)
        return None
    if hasattr(model, "final_layer_norm") or hasattr(model, "ln_f"):
        return getattr(model, "final_layer_norm", None) or model.ln_f
    head = getattr(model, "head", None)
    return head if isinstance(head, nn.Module) else None


def get_act_offloading_ctx_manager(model: nn.Module, use_pin_memory: bool = True, use_streams: bool = True,
                                   min_offload_size: int = 1024, max_fwd_stash_size: int = 5,
                                   warn_if_no_head: bool = True) -> OffloadActivations:
    """``OffloadActivations`` for ``model`` with its output head (behind ``.module`` and a PEFT
    model's ``.base_model``) and every module named ``*liger*`` kept out of offloading. Logs
    upstream's warning when no head is found, unless ``warn_if_no_head=False``."""
    manager = OffloadActivations(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                 min_offload_size=min_offload_size, max_fwd_stash_size=max_fwd_stash_size)
    manager.update_model_params(model)
    unwrapped = model.module if hasattr(model, "module") else model
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    head = _head(unwrapped)
    if head is not None:
        _opt_out(head)
    elif warn_if_no_head:
        logger.warning(NO_HEAD_WARNING)
    for name, module in unwrapped.named_modules():
        if "liger" in name.lower():
            _opt_out(module)
    return manager

"""``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` on the acshim engine.

Mirrors torch's module (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py). The wrapper
classes subclass torch's, so module prefixes (``_checkpoint_wrapped_module``), the state-dict hooks
that strip and restore it, ``named_parameters`` stripping and ``__getattr__`` / ``__getitem__``
forwarding are torch's own, and ``isinstance(m, torch's CheckpointWrapper)`` holds.
``CheckpointImpl`` is torch's enum. ``apply_activation_checkpointing`` is torch's policy walk (FSDP
wrap policies, ``check_fn``, nested wrapping, root never wrapped) with this module's
``checkpoint_wrapper`` as the default wrapper.

What runs differs: the default ``checkpoint_fn`` is ``acshim.checkpoint`` (same keywords:
``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug``, ``early_stop``; same errors);
a user ``checkpoint_fn`` is honoured as upstream does (keyword arguments packed for REENTRANT).
``offload_wrapper`` routes every saved tensor to the engine's storage tier instead of
``save_on_cpu(pin_memory=True)``, which on a CPU-only machine copies every saved tensor (34% more
memory held); here CPU tensors are never copied. Deliberate extras: the pre-2.1 keyword
``offload_to_cpu=True`` keeps the region's inputs on the host (torch 2.1+ forwards it into the
module's ``forward``, a TypeError); a REENTRANT wrapper emits the FutureWarning torch 2.1-2.x emitted
(torch 2.13 no longer warns).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as _torch_wrapper
from torch import nn
from torch.distributed.utils import _pack_kwargs, _unpack_kwargs

from acshim.dropin import checkpoint as acshim_checkpoint
from acshim.dropin import noop_context_fn
from acshim.facades.torch.distributed import ACSHIM_PATCHES  # this module is the torch dialect's facade root
from acshim.options import RegionOptions
from acshim.region_dialect import current, made_by

from ._storage import host_boundary_offload, offload_scope


def _original(obj: Any) -> Any:
    """The object itself, or the original behind a wrapt proxy if torch's module is already patched."""
    return getattr(obj, "__wrapped__", obj)


_TorchCheckpointWrapper = _original(_torch_wrapper.CheckpointWrapper)
_TorchOffloadWrapper = _original(_torch_wrapper.OffloadWrapper)
_torch_apply_activation_checkpointing = _original(_torch_wrapper.apply_activation_checkpointing)

ActivationWrapper = _original(_torch_wrapper.ActivationWrapper)
CheckpointImpl = _original(_torch_wrapper.CheckpointImpl)
_CHECKPOINT_WRAPPED_MODULE: str = _torch_wrapper._CHECKPOINT_WRAPPED_MODULE
_CHECKPOINT_PREFIX: str = _torch_wrapper._CHECKPOINT_PREFIX


DIALECT = "torch checkpoint_wrapper"
"""How ``acshim run --report`` names this facade's regions, unless a library that builds the
wrappers for its users names itself (``region_dialect.made_by``: Modalities, torchtitan, Lightning)."""

_REGION_KEYWORDS = ("preserve_rng_state", "determinism_check", "debug", "early_stop", "context_fn")


def _check_checkpoint_kwargs(checkpoint_impl: CheckpointImpl, kwargs: dict[str, Any]) -> None:
    """The checkpoint keywords among ``checkpoint_fn_kwargs`` are checked now, with the errors
    ``acshim.checkpoint`` would give at the first forward (others are the module's keywords)."""
    given = {key: kwargs[key] for key in _REGION_KEYWORDS if key in kwargs}
    if given.get("context_fn") is noop_context_fn:
        del given["context_fn"]
    RegionOptions(reentrant=checkpoint_impl == CheckpointImpl.REENTRANT, **given)


class CheckpointWrapper(_TorchCheckpointWrapper):
    """Wraps ``mod`` (as ``self._checkpoint_wrapped_module``) so every call is a checkpointed region.

    ``checkpoint_impl``: ``CheckpointImpl.NO_REENTRANT`` (default) or ``REENTRANT``; ignored by a custom
    ``checkpoint_fn`` except that keyword arguments are then packed into positional ones, as upstream.
    ``checkpoint_fn_kwargs`` go to ``checkpoint_fn`` (default: ``acshim.checkpoint``).
    ``acshim_dialect``: the API its regions are reported as (``DIALECT``, or the library that built it).
    """

    def __init__(self, mod: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                 checkpoint_fn: Callable[..., Any] | None = None, **checkpoint_fn_kwargs: Any) -> None:
        if not isinstance(checkpoint_impl, CheckpointImpl):
            raise ValueError(f"checkpoint_impl must be CheckpointImpl.NO_REENTRANT or CheckpointImpl.REENTRANT, "
                             f"got {checkpoint_impl!r}")
        if checkpoint_fn is not None and not callable(checkpoint_fn):
            raise TypeError(f"checkpoint_fn must be a checkpoint function (or None for the default), got {checkpoint_fn!r}")
        if checkpoint_fn is None:
            _check_checkpoint_kwargs(checkpoint_impl, checkpoint_fn_kwargs)
        ActivationWrapper.__init__(self, mod)
        self.checkpoint_impl = checkpoint_impl
        self.acshim_dialect = current() or DIALECT
        self._inputs_scope = None
        if checkpoint_fn is None and checkpoint_fn_kwargs.pop("offload_to_cpu", False):
            self._inputs_scope = host_boundary_offload()
        if checkpoint_fn is None:
            self.checkpoint_fn = partial(acshim_checkpoint, use_reentrant=checkpoint_impl == CheckpointImpl.REENTRANT,
                                         **checkpoint_fn_kwargs)
        else:
            self.checkpoint_fn = partial(checkpoint_fn, **checkpoint_fn_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._inputs_scope() if self._inputs_scope is not None else contextlib.nullcontext()
        with scope, made_by(getattr(self, "acshim_dialect", DIALECT)):
            if self.checkpoint_impl == CheckpointImpl.REENTRANT and kwargs:
                # Reentrant checkpoint functions take positional inputs only: pack the keyword
                # values in (so tensors among them get gradients) and unpack inside the region.
                flat_args, kwarg_keys = _pack_kwargs(*args, **kwargs)

                def run_unpacked(*inputs: Any) -> Any:
                    unpacked_args, unpacked_kwargs = _unpack_kwargs(inputs, kwarg_keys)
                    return self._checkpoint_wrapped_module(*unpacked_args, **unpacked_kwargs)

                return self.checkpoint_fn(run_unpacked, *flat_args)
            return self.checkpoint_fn(self._checkpoint_wrapped_module, *args, **kwargs)


class OffloadWrapper(_TorchOffloadWrapper):
    """Wraps ``mod`` so every tensor autograd saves inside it goes to the engine's storage tier
    (``acshim.offload``); nothing is recomputed. CPU tensors are never copied."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with offload_scope():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def _user_stacklevel() -> int:
    """``stacklevel`` pointing at the user's call, past acshim's in-place patch forwarder if any."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("acshim.patching", "wrapt")):
        level, frame = level + 1, frame.f_back
    return level


def checkpoint_wrapper(module: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Callable[..., Any] | None = None, **checkpoint_fn_kwargs: Any) -> nn.Module:
    """Return ``CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)``.

    >>> block = checkpoint_wrapper(block, preserve_rng_state=True)
    >>> out = block(x)   # block's activations are recomputed in backward
    """
    if checkpoint_impl == CheckpointImpl.REENTRANT:
        warnings.warn(
            f"Please specify {CheckpointImpl.NO_REENTRANT} as {CheckpointImpl.REENTRANT} will soon be removed as "
            "the default and eventually deprecated.", FutureWarning, stacklevel=_user_stacklevel())
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Return ``OffloadWrapper(module)``: the module's saved activations live in the engine's storage tier."""
    return OffloadWrapper(module)


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Any = None,
) -> None:
    """Replace, in place, the submodules of ``model`` that ``auto_wrap_policy`` (if given: a callable
    FSDP policy or a ``_Policy`` such as ``ModuleWrapPolicy``) or else ``check_fn`` selects with
    ``checkpoint_wrapper_fn(submodule)``. Children are wrapped before parents (both when both
    match); the root is never wrapped. Returns None.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_activation_checkpointing needs an nn.Module as model, got {type(model).__name__}")
    for name, value in (("checkpoint_wrapper_fn", checkpoint_wrapper_fn), ("check_fn", check_fn)):
        if not callable(value):
            raise TypeError(f"apply_activation_checkpointing: {name} must be callable, got {value!r}")
    dialect = _calling_dialect()
    with made_by(dialect) if dialect is not None else contextlib.nullcontext():  # names the wrappers built
        _torch_apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper_fn, check_fn=check_fn,
                                              auto_wrap_policy=auto_wrap_policy)


# Libraries that call apply_activation_checkpointing for their users, by the config they read it from.
_CALLING_DIALECTS = {"lightning": "lightning FSDPStrategy", "pytorch_lightning": "lightning FSDPStrategy",
                     "lightning_fabric": "lightning FSDPStrategy"}


def _calling_dialect() -> str | None:
    """The dialect of the library that called ``apply_activation_checkpointing`` (Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)``), None for a user's own call. The one
    caller acshim finds from the stack (a frame, once per call, not per region): Lightning has no
    facade of its own to say so with ``region_dialect.made_by``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("acshim.", "wrapt")):
        frame = frame.f_back
    package = frame.f_globals.get("__name__", "").split(".")[0] if frame is not None else ""
    return _CALLING_DIALECTS.get(package)


__all__ = [
    "ACSHIM_PATCHES", "ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper", "_CHECKPOINT_PREFIX",
    "_CHECKPOINT_WRAPPED_MODULE", "apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper",
]

"""Route a script's own ``torch.utils.checkpoint.checkpoint`` calls to the engine.

``acshim run`` leaves torch alone: a script that calls torch's checkpoint gets torch's checkpoint.
Under ``--budget`` and ``--report`` those calls must reach the engine too, or the plan could not
replace them and the report could not count them ("any dialect" includes torch's own). So while
either is on, ``torch.utils.checkpoint.checkpoint`` is replaced by ``routed_checkpoint``: torch's
signature, defaults, warning and errors (torch/utils/checkpoint.py: ``use_reentrant`` unset warns
and means True), the region run by ``acshim.region.run_region``. ``checkpoint_sequential`` looks
the name up at call time, so its segments are routed too. The engine keeps calling torch's own
function (``acshim.region.TORCH_CHECKPOINT``), and while Dynamo traces, the call goes to torch's
own too, which Dynamo captures as its checkpoint operator.

Hugging Face models that call torch's checkpoint themselves (transformers' CLVP and Grounding DINO
do, instead of ``_gradient_checkpointing_func``) are the exception: ``acshim.install()`` routes
the calls made from transformers' code (``TRANSFORMERS_CALLERS``) always, so every Hugging Face
model's checkpointing runs on the engine under ``acshim run`` (torch's reentrant checkpoint would
give such a block's parameters no gradient when its input needs none, and fails under DDP's
unused-parameter search); calls made anywhere else stay torch's own until ``--budget``/``--report``
route them all.

torch's own selective-checkpoint policies that offload (``CheckpointPolicy.MUST_CPU_OFFLOAD`` /
``PREFER_CPU_OFFLOAD`` from a ``context_fn`` made by ``create_selective_checkpoint_contexts``) are
the other exception: torch honours them only when compiled and quietly recomputes those ops in eager
mode. ``acshim.install()`` (so ``acshim run``, with or without ``--budget``/``--report``) routes every
call given a ``context_fn`` (``route_offload_policies``), and every routed call's policy offloads to
the storage tier (``acshim.selective.honour_offload``), the tier taken as torchtune's and TRL's
facades take it: ``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR``, else ``acshim.storage``'s
defaults. A deliberate difference from torch's eager behaviour.

A plain attribute swap rather than ``acshim.patching.inplace``: that machinery refuses
``torch.utils.checkpoint`` on purpose (a facade forwarding it would recurse into the engine), and
this one swap is undone by ``unroute_torch_checkpoint``.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .. import dropin
from ..compiled import TracedCall
from ..facades._env import offload_storage
from ..region import TORCH_CHECKPOINT
from ..region_dialect import made_by
from ..selective import honour_offload
from ..storage import BoundaryOffload, boundary_offload, get_defaults

USE_REENTRANT_WARNING = (
    "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. Starting in PyTorch 2.9, "
    "calling checkpoint without use_reentrant will raise an exception. use_reentrant=False is recommended, but if "
    "you need to preserve the current default behavior, you can pass use_reentrant=True. Refer to docs for more "
    "details on the differences between the two variants.")
"""torch 2.13's wording, kept so a routed call warns exactly as torch would."""


TRANSFORMERS_CALLERS = ("transformers.", "transformers_modules.")
"""Module-name prefixes of transformers' own code and of models loaded with ``trust_remote_code``."""


@dataclass
class _Routes:
    """This module's whole state: which calls are routed, and the storage scope routed offload
    policies share (dropped once nothing is routed: ``uninstall()`` leaves none behind)."""

    everything: bool = False
    callers: tuple[str, ...] = ()
    """Prefixes of the modules whose calls are routed when not ``everything``."""
    policies: bool = False
    """Route every call given a ``context_fn`` (a selective-checkpoint policy may offload)."""
    policy_scopes: dict[tuple[object, ...], BoundaryOffload] = field(default_factory=dict)
    """``policy_scope()``'s scope, by the tier setting it was made for."""


_routes = _Routes()

DIALECT = "torch.utils.checkpoint"
"""How ``acshim run --report`` and the ``--budget`` plan name the regions routed here."""

POLICY_ORIGIN = "torch.utils.checkpoint policy"
"""How ``acshim run --report`` names the storage scope of torch's offload policies."""


def policy_scope() -> BoundaryOffload:
    """The storage scope the offload decisions of routed calls go to: one per tier setting
    (``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR``, else ``acshim.storage.get_defaults()``),
    so every region of a step shares one prefetch schedule."""
    storage, directory = offload_storage()
    key = (storage, directory, get_defaults())
    scopes = _routes.policy_scopes
    scope = scopes.get(key)
    if scope is None:
        scopes.clear()
        # horizon 0: every offloaded output leaves in forward and comes back when its recompute needs
        # it, so held memory is never above full recompute's (a horizon H keeps the last H regions'
        # outputs resident); a script wanting overlap uses acshim.selective.offload_policies(prefetch=H)
        scope = scopes[key] = boundary_offload(storage, 0, directory)
        scope.session.origin = POLICY_ORIGIN
    return scope


def _has_policy(kwargs: dict[str, Any]) -> bool:
    context_fn = kwargs.get("context_fn")
    return context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn


@functools.wraps(TORCH_CHECKPOINT)
def routed_checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
                      **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` with the region run by acshim's engine."""
    if torch.compiler.is_compiling() or isinstance(function, TracedCall):
        # traced: Dynamo takes this very function for its checkpoint operator (it compares identity with
        # torch.utils.checkpoint.checkpoint); run eagerly for a region Dynamo gave up on: torch's own
        return TORCH_CHECKPOINT(function, *args, use_reentrant=use_reentrant, **kwargs)
    if use_reentrant is None:  # torch's warning, at the caller's line (torch's own would point here)
        warnings.warn(USE_REENTRANT_WARNING, stacklevel=2)
        use_reentrant = True
    policy = _has_policy(kwargs)
    if not (_routes.everything or (policy and _routes.policies)
            or sys._getframe(1).f_globals.get("__name__", "").startswith(_routes.callers)):
        return TORCH_CHECKPOINT(function, *args, use_reentrant=use_reentrant, **kwargs)
    if policy and not use_reentrant:  # torch's reentrant variant rejects a context_fn: its error, below
        kwargs["context_fn"] = honour_offload(kwargs["context_fn"], policy_scope())
    with made_by(DIALECT):
        return dropin.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def route_torch_checkpoint(callers: tuple[str, ...] | None = None) -> bool:
    """Send ``torch.utils.checkpoint.checkpoint`` calls to the engine: every call, or with ``callers``
    only those made from modules whose name starts with one of these prefixes. False when nothing
    changed: already routed so (nothing is stacked), or something else replaced torch's function
    (then it is left as it is)."""
    if torch_checkpoint.checkpoint not in (TORCH_CHECKPOINT, routed_checkpoint):
        return False
    if callers is None:
        if _routes.everything:
            return False
        _routes.everything = True
    else:
        new = tuple(prefix for prefix in callers if prefix not in _routes.callers)
        if not new:
            return False
        _routes.callers += new
    torch_checkpoint.checkpoint = routed_checkpoint
    return True


def route_offload_policies() -> bool:
    """Send the calls given a ``context_fn`` to the engine, where offload policies offload (see the
    module). False when nothing changed (already routed, or something else replaced torch's function)."""
    if torch_checkpoint.checkpoint not in (TORCH_CHECKPOINT, routed_checkpoint) or _routes.policies:
        return False
    _routes.policies = True
    torch_checkpoint.checkpoint = routed_checkpoint
    return True


def unroute_offload_policies() -> None:
    """Undo ``route_offload_policies``; torch's own ``checkpoint`` is back once nothing is routed."""
    _routes.policies = False
    _restore_if_unrouted()


def unroute_torch_checkpoint(callers: tuple[str, ...] | None = None) -> None:
    """Undo ``route_torch_checkpoint`` with the same ``callers``; torch's own ``checkpoint`` is back
    once nothing is routed."""
    if callers is None:
        _routes.everything = False
    else:
        _routes.callers = tuple(prefix for prefix in _routes.callers if prefix not in callers)
    _restore_if_unrouted()


def _restore_if_unrouted() -> None:
    if _routes.everything or _routes.callers or _routes.policies:
        return
    _routes.policy_scopes.clear()
    if torch_checkpoint.checkpoint is routed_checkpoint:
        torch_checkpoint.checkpoint = TORCH_CHECKPOINT

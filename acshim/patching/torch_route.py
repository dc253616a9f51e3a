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

A plain attribute swap rather than ``acshim.patching.inplace``: that machinery refuses
``torch.utils.checkpoint`` on purpose (a facade forwarding it would recurse into the engine), and
this one swap is undone by ``unroute_torch_checkpoint``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .. import dropin
from ..compiled import _TracedCall
from ..region import TORCH_CHECKPOINT

USE_REENTRANT_WARNING = (
    "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. Starting in PyTorch 2.9, "
    "calling checkpoint without use_reentrant will raise an exception. use_reentrant=False is recommended, but if "
    "you need to preserve the current default behavior, you can pass use_reentrant=True. Refer to docs for more "
    "details on the differences between the two variants.")
"""torch 2.13's wording, kept so a routed call warns exactly as torch would."""


@functools.wraps(TORCH_CHECKPOINT)
def routed_checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
                      **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` with the region run by acshim's engine."""
    if torch.compiler.is_compiling() or isinstance(function, _TracedCall):
        # traced: Dynamo takes this very function for its checkpoint operator (it compares identity with
        # torch.utils.checkpoint.checkpoint); run eagerly for a region Dynamo gave up on: torch's own
        return TORCH_CHECKPOINT(function, *args, use_reentrant=use_reentrant, **kwargs)
    if use_reentrant is None:
        warnings.warn(USE_REENTRANT_WARNING, stacklevel=2)
        use_reentrant = True
    return dropin.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def route_torch_checkpoint() -> bool:
    """Send ``torch.utils.checkpoint.checkpoint`` calls to the engine; False when already routed
    (or when something else replaced torch's function: then it is left as it is)."""
    if torch_checkpoint.checkpoint is not TORCH_CHECKPOINT:
        return False
    torch_checkpoint.checkpoint = routed_checkpoint
    return True


def unroute_torch_checkpoint() -> None:
    """Put torch's own ``checkpoint`` back (nothing to do when it was not routed)."""
    if torch_checkpoint.checkpoint is routed_checkpoint:
        torch_checkpoint.checkpoint = TORCH_CHECKPOINT

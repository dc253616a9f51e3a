"""The state a region's forward read, checked before the recompute reads it again.

A recompute runs the region's forward a second time, in backward. Parameters or buffers changed in
between (an optimizer step, an EMA or weight-averaging update, a ``p.add_`` under ``no_grad``)
make the recompute differ from the forward, and the gradients come out computed from the changed
weights. Plain torch raises its in-place error for a saved tensor changed that way; torch's own
checkpoint recomputes silently from the new values. acshim raises torch's error instead, naming
the tensor: version counters of every parameter and buffer of the region's modules
(``acshim.region_modules``, or the modules seen running) and of the tensors its callable
references (a closure's weight) are recorded when the forward ends and compared just before the
recompute.

Left out: buffers the forward itself changed (``acshim.region_buffers`` puts their pre-forward
state in place for the recompute) and parameters whose framework swaps their data between forward
and backward through module hooks (ZeRO-3's partitioned and FSDP1's flat parameters, which are
gathered again for backward). FSDP2 gathers into the same parameters without moving their version
counters, as it must for plain autograd too. Like torch's own check this reads version counters
only: ``p.data.add_()`` moves none and is not seen, exactly as plain torch does not see it, and a
buffer rewritten in place with the values it had counts as changed, as it does for torch. (DDP's
``broadcast_buffers`` before a second forward ahead of one backward moves no version counter:
measured on 2 gloo ranks, torch 2.13.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .region_aliases import aliasable
from .region_buffers import Change
from .storage.versions import modified_error

Reads = list[tuple[torch.Tensor, int, str]]
"""(tensor, its version when the forward ended, a name for the error message)."""


def record(modules: Iterable[nn.Module], changes: list[Change] | None,
           referenced: Iterable[torch.Tensor] = ()) -> Reads:
    """The versions, as the forward leaves them, of what the recompute will read again."""
    changed = {(id(module), name) for module, name, _ in changes or ()}
    reads: Reads = []
    seen: set[int] = set()

    def add(tensor: torch.Tensor | None, name: str) -> None:
        if tensor is None or id(tensor) in seen or tensor.is_inference() or not aliasable(tensor):
            return
        seen.add(id(tensor))
        reads.append((tensor, tensor._version, name))

    for module in modules:
        kind = type(module).__name__
        for name, parameter in module._parameters.items():
            add(parameter, f"parameter '{name}' of {kind}")
        for name, buffer in module._buffers.items():
            if (id(module), name) not in changed:
                add(buffer, f"buffer '{name}' of {kind}")
    for tensor in referenced:
        add(tensor, "a tensor the region's callable references")
    return reads


def check(reads: Reads | None) -> None:
    """Torch's in-place error for the first recorded tensor changed since the forward."""
    for tensor, version, name in reads or ():
        if tensor._version != version:
            error = modified_error(tensor, version)
            raise RuntimeError(f"{error} (acshim: the {name}, read by a checkpointed region's forward, "
                               "was changed in place before backward recomputed that region: the "
                               "recompute would compute gradients from the changed values. Change "
                               "weights after backward, or run this region without checkpointing.)")

"""Output-discarding regions: a checkpointed call whose output storage is released in forward and
rebuilt, by recompute, when a chosen tensor's gradient arrives.

A plain region keeps its output, which the next op usually saves for its own backward: the same
activation is then held twice (by the caller's graph and as the next region's input). Megatron-core's
``CheckpointWithoutOutput`` (megatron/core/tensor_parallel/random.py) frees that copy: after the
consumer has saved the output, ``discard(hook_tensor)`` resizes the output's storage to zero and
registers the recompute as a gradient hook on ``hook_tensor``, which must get its gradient before
anything reads the output in backward. The recompute writes the values back into the same storage,
so every saved reference sees them again. RNG (CPU, device, tracker streams) is restored for it.

Differences from Megatron's: a backward that reaches the region before the hook ran (``discard``
never called, or a hook tensor that needs no grad) recomputes there instead of failing, and the
region counts in ``acshim run``'s region totals and ``--report``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import rng
from .options import RegionOptions
from .region import STATS
from .region_dialect import ENGINE
from .state import state

GRAD_ERROR = "Checkpointing is not compatible with .grad(), please use .backward() if possible"


class _RNGSnapshot:
    """CPU, device and tracker generator states as a forward starts."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.cpu = torch.get_rng_state()
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []
        if self.device_type != "cpu":
            self.devices, self.device_states = torch_checkpoint.get_device_states(*tensors)
        self.trackers = rng.capture_tracker_states()

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            if self.devices:
                torch_checkpoint.set_device_states(self.devices, self.device_states, device_type=self.device_type)
            with rng.restored_tracker_states(self.trackers):
                yield


class DiscardedOutputRegion:
    """One call checkpointed with its output released until ``discard``'s hook tensor gets its grad.

    >>> region = DiscardedOutputRegion()
    >>> normed = region.run(norm, hidden)            # forward, no graph kept inside ``norm``
    >>> out = mlp(normed)                            # ``mlp`` saves ``normed`` for its backward
    >>> region.discard(out)                          # ``normed``'s storage freed until out's grad

    ``dialect``: the API that made it, as ``acshim run --report`` names it (a facade's name).
    """

    def __init__(self, dialect: str = ENGINE) -> None:
        self._options = RegionOptions(reentrant=True, dialect=dialect)  # how --report describes the region
        self._function: Callable[..., Any] | None = None
        self._ctx: Any = None
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._rng: _RNGSnapshot | None = None

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` as the region (a plain call without grad or with checkpointing off)."""
        if state.is_checkpointing_disabled or not torch.is_grad_enabled():
            return function(*args)
        if STATS.recorder is not None:
            STATS.recorder.call(function, args, {}, self._options)
        self._function = function
        self._rng = _RNGSnapshot([a for a in args if isinstance(a, torch.Tensor)])
        STATS.forward(function)
        output = _DiscardFunction.apply(self, *args)
        self._outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
        return output

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Release the output storages; recompute them when ``hook_tensor``'s gradient is computed."""
        if self._outputs is None:
            return
        for output in self._outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._rebuild)

    def _rebuild(self, _grad: torch.Tensor | None = None) -> None:
        ctx = self._ctx
        if ctx is None:  # rebuilt already
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(GRAD_ERROR)
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        args = ctx.rebuild_args(inputs)
        assert self._rng is not None and self._function is not None
        STATS.recompute(self._function)
        with self._rng.restored(), torch.enable_grad():
            output = self._function(*args)
        outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
        with torch.no_grad():
            for kept, fresh in zip(self._outputs or (), outputs):
                storage = kept.untyped_storage()
                if storage.size() == 0:  # discarded: the values go back where saved references read them
                    storage.resize_(fresh.untyped_storage().size())
                    storage.copy_(fresh.untyped_storage())
        ctx.recomputed = (inputs, outputs)
        self._ctx, self._function, self._rng, self._outputs = None, None, None, None


class _DiscardFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, region: DiscardedOutputRegion, *args: Any) -> Any:
        assert region._function is not None
        with torch.no_grad():
            output = region._function(*args)
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def rebuild_args(tensors: tuple[torch.Tensor, ...]) -> list[Any]:
            rebuilt = list(args)
            for position, tensor in zip(positions, tensors):
                rebuilt[position] = tensor
            return rebuilt

        ctx.rebuild_args = rebuild_args
        ctx.save_for_backward(*(args[i] for i in positions))
        ctx.positions = positions
        ctx.count = len(args)
        ctx.recomputed = None
        ctx.region_ref = weakref.ref(region)
        region._ctx = ctx
        return output

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        region = ctx.region_ref()
        if ctx.recomputed is None and region is not None:
            region._rebuild()
        if ctx.recomputed is None:
            raise RuntimeError("acshim: an output-discarding region reached backward without its recompute "
                               "(the region object was dropped before backward); keep it alive until backward")
        inputs, outputs = ctx.recomputed
        ctx.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = iter(t.grad for t in inputs)
        return (None, *(next(input_grads) if i in ctx.positions else None for i in range(ctx.count)))

"""Count what a selective region's forward caches for its backward, without holding any more of it.

A sharded model's sampled step (``lockstep.SAMPLED``) runs one region of each kind ``selective``
(or ``selective-alt``); what that choice holds beyond recompute is the operator outputs its policy
saves. The process's memory after one region's forward says it only up to the allocator's noise
(the heap grows by pages the forward's temporaries used), so those outputs are counted instead, as
``lockstep.SavedCounter`` counts what keeping a region would hold.

Torch's selective checkpoint asks its policy about each operator with the operator's output in
hand (``SelectiveCheckpointContext.op_output``, torch.utils.checkpoint); ``SelectiveSaved`` wraps
the policy of the forward context a ``context_fn`` makes and counts, once per storage, each output
the policy saves. Written by hand: torch has no public count of what selective checkpoint caches."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .. import structures
from ..measure import storage_key

SAVING = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


class SelectiveSaved:
    """A ``context_fn`` that makes ``context_fn``'s contexts and counts, in ``total``, the bytes of
    the operator outputs its forward context's policy saves (storages in ``excluded`` left out: the
    region's inputs, held by recompute as well). ``counted`` is False where the forward context has
    no policy to wrap (a torch without ``op_output``, or a context of another kind)."""

    def __init__(self, context_fn: ContextFn, excluded: set[int]) -> None:
        self.context_fn, self.excluded = context_fn, excluded
        self.total = 0
        self.counted = False
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        """Storage id -> a tensor on it, weakly (nothing held; an id reused later counts anew)."""

    def __call__(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = self.context_fn()
        policy = getattr(forward, "policy_fn", None)
        if callable(policy):
            forward.policy_fn = self._counting(policy)  # type: ignore[attr-defined]
            self.counted = True
        return forward, recompute

    def _counting(self, policy: Callable[..., Any]) -> Callable[..., Any]:
        def counting_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy(ctx, func, *args, **kwargs)
            output = getattr(ctx, "op_output", None)
            if output is None:
                self.counted = False  # this torch does not hand the output to the policy
            elif decision is True or decision in SAVING:
                self._count(output)
            return decision

        return counting_policy

    def _count(self, output: Any) -> None:
        for leaf in structures.flatten(output)[0]:
            found = storage_key(leaf) if isinstance(leaf, torch.Tensor) else None
            if found is None or found[0] in self.excluded:
                continue
            seen = self._seen.get(found[0])
            if seen is None or seen() is None:
                self._seen[found[0]] = weakref.ref(leaf)
                self.total += found[1].nbytes()

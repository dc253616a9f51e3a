"""Selective-op checkpointing: inside a region, keep the outputs of chosen operators and recompute
the rest. Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts``; the result is a
``context_fn`` for ``RegionOptions`` / ``acshim.checkpoint`` (non-reentrant regions only).

The "save every other matmul" rule is the one torchtitan and Modalities use
(torchtitan/distributed/activation_checkpoint.py, modalities activation_checkpointing.py): the 1st,
3rd, 5th... ``mm`` of a region is saved, the others recomputed; counters are per region call and
kept apart for forward and recompute.

Offload policies: a policy may return ``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``
(torch.utils.checkpoint, torch >= 2.5). Torch honours them only in compiled graphs; in eager torch
quietly recomputes those ops. In acshim regions (``honour_offload``, applied by every non-reentrant
region) the op's output is kept, as ``MUST_SAVE`` would, but its bytes go to acshim's storage tier
(``storage.set_defaults``, or ``offload_policies(context_fn, storage="disk")``) and come back, bit for
bit and prefetched, when the recompute reaches the op. An output the forward changed in place after
the op (``h = lin(t); h.mul_(2)``) is recomputed instead, as torch does in eager mode.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .random_ops import recompute_random_ops

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

aten = torch.ops.aten

#: Compute-heavy operators worth keeping (matmuls and attention), a sensible default save list.
DEFAULT_SAVE_OPS: tuple[Any, ...] = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def resolve_op(op: Any) -> Any:
    """An ``OpOverload`` from an overload, or from a dotted name such as ``"aten.mm.default"``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        raise ValueError(f"{op} is an operator packet; name one overload, e.g. {op}.default")
    if isinstance(op, str):
        target: Any = torch.ops
        for part in op.removeprefix("ops.").removeprefix("torch.ops.").split("."):
            target = getattr(target, part, None)
            if target is None:
                raise ValueError(f"unknown operator {op!r}; name an overload such as 'aten.mm.default'")
        return resolve_op(target)
    raise TypeError(f"expected an operator overload or its dotted name, got {type(op).__name__}")


class _SaveOpsPolicy:
    """Per region call: MUST_SAVE listed ops, PREFER_RECOMPUTE the rest (and every other mm)."""

    def __init__(self, save: frozenset[Any], alternate: frozenset[Any]) -> None:
        self.save, self.alternate = save, alternate
        self.counts = {False: 0, True: 0}  # alternating-op count in forward and in recompute

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.alternate:
            recompute = bool(getattr(ctx, "is_recompute", False))
            self.counts[recompute] += 1
            if self.counts[recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in self.save else CheckpointPolicy.PREFER_RECOMPUTE


def save_ops(ops: Iterable[Any] = DEFAULT_SAVE_OPS, *, recompute_every_other: Iterable[Any] = ()) -> ContextFn:
    """A ``context_fn`` that saves the outputs of ``ops`` inside the region and recomputes the rest.

    ``recompute_every_other``: operators of which only the 1st, 3rd, 5th... call is saved (torchtitan's
    and Modalities' rule for ``aten.mm.default``).

    >>> acshim.apply_checkpointing(model, context_fn=acshim.selective.save_ops())
    """
    save = frozenset(resolve_op(op) for op in ops)
    alternate = frozenset(resolve_op(op) for op in recompute_every_other)
    if not save:
        raise ValueError("save_ops needs at least one operator to save; to save nothing use full checkpointing")

    def context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = create_selective_checkpoint_contexts(_SaveOpsPolicy(save, alternate))
        return forward, _recompute_unsaved_extra_ops(recompute)

    return functools.update_wrapper(context_fn, save_ops)


class _AlwaysRecompute:
    """The cache of an op the forward saved no output of: every call of it is recomputed."""

    def get(self, index: Any, default: Any = None) -> Any:
        return _RECOMPUTE


class _UnsavedOpsRecomputed:
    """Torch's SAC storage as the recompute reads it (torch >= 2.13 keeps one entry per op call and
    raises "encountered during backward but not found in storage" for a call the forward did not
    make): an op none of whose forward calls was saved is recomputed at any call, so that operators
    run only in the recompute are run, as plain recompute runs them. Those are parameter gathers:
    DeepSpeed ZeRO-3's and FSDP's pre-forward hooks gather a module's parameters again in the
    recompute (``torch.cat(..., out=...)``) where the forward found them prefetched. An op with a
    saved output keeps torch's check (more calls of it than the forward made raise torch's error).
    What this gives up: torch's error for a recompute that differs from its forward in unsaved
    operators only (state changed between them); acshim's full recompute, like torch's
    ``checkpoint`` without a policy, has never had that check either."""

    def __init__(self, storage: dict[Any, Any]) -> None:
        self.storage = storage
        self.unsaved: dict[Any, bool] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        entries = self.storage.get(key)
        if entries is None:
            return _ALWAYS_RECOMPUTE
        unsaved = self.unsaved.get(key)
        if unsaved is None:  # once per op: what the forward saved does not change in the recompute
            unsaved = self.unsaved[key] = all(entry is _RECOMPUTE for entry in entries.values())
        return _ALWAYS_RECOMPUTE if unsaved else entries

    def __getattr__(self, name: str) -> Any:  # anything else torch reads (values, items) as stored
        return getattr(self.storage, name)


def _recompute_unsaved_extra_ops(recompute: Any) -> Any:
    """``recompute`` (torch's ``_CachedTorchDispatchMode``) reading its storage through
    ``_UnsavedOpsRecomputed``; as it is on torches whose storage is not per call (before 2.13)."""
    storage = getattr(recompute, "storage", None)
    if _RECOMPUTE is not None and isinstance(storage, dict):
        recompute.storage = _UnsavedOpsRecomputed(storage)
    return recompute


# ------------------------------------------------------------------------------------------------
# offload policies in eager mode

_OFFLOAD_POLICIES = {
    getattr(CheckpointPolicy, name): CheckpointPolicy.MUST_SAVE if name.startswith("MUST") else CheckpointPolicy.PREFER_SAVE
    for name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD") if hasattr(CheckpointPolicy, name)
}


class _OffloadedEntry:
    """Stands in for torch's cached ``_VersionWrapper`` of one saved op output: its bytes live in
    the storage tier (a session handle) and ``get_val`` brings them back, bitwise."""

    __slots__ = ("session", "packed")

    def __init__(self, session: Any, tensor: torch.Tensor) -> None:
        self.session = session
        self.packed = session.pack(tensor)

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        return self.session.unpack(self.packed)  # torch's in-place error if changed (see _RecomputeChanged)

    def modified(self) -> bool:
        """True if the op's output was changed in place after it was cached (forward went on
        writing into it): the bytes in the tier may not be the op's output any more."""
        packed = self.packed
        if type(packed) is tuple:  # kept in place (host tier on CPU)
            tensor, version = packed
            return tensor._version != version
        return packed.modified()


class _RecomputeChanged:
    """The recompute context of a region with offload decisions: before the recompute replays the
    cache, every offloaded op output that the forward changed in place afterwards (``h = lin(t);
    h.mul_(2)``) is marked for recomputation. Torch in eager mode recomputes offload-policy ops, so
    this is torch's result, bitwise; replaying the changed bytes would apply the change twice.
    Reusable: torch enters the recompute context again for a second backward."""

    def __init__(self, mode: Any, storage: dict[Any, Any]) -> None:
        self.mode, self.storage = mode, storage

    def __enter__(self) -> Any:
        if _RECOMPUTE is not None:
            for entries in self.storage.values():
                if not isinstance(entries, dict):  # torch before 2.13: no index to mark
                    continue
                for index, entry in list(entries.items()):
                    if any(isinstance(leaf, _OffloadedEntry) and leaf.modified() for leaf in tree_leaves(entry)):
                        dict.__setitem__(entries, index, _RECOMPUTE)
        return self.mode.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        return self.mode.__exit__(*exc_info)


_RECOMPUTE = getattr(torch_checkpoint, "_RECOMPUTE", None)
"""torch's "recompute this op" cache entry; without it a changed entry raises torch's in-place error."""
_ALWAYS_RECOMPUTE = _AlwaysRecompute()


class _Marker(threading.local):
    offload_next = False


class _Offloader:
    """Moves an op's cached output to the storage tier when it is stored right after an offload
    decision (torch's caching mode stores each output just after asking the policy)."""

    def __init__(self, marker: _Marker, session: Any) -> None:
        self.marker, self.session = marker, session

    def __call__(self, value: Any) -> Any:
        if self.marker.offload_next:
            self.marker.offload_next = False
            value = tree_map(self._offload, value)
        return value

    def _offload(self, leaf: Any) -> Any:
        val = getattr(leaf, "val", None)
        if isinstance(val, torch.Tensor) and hasattr(leaf, "get_val"):
            return _OffloadedEntry(self.session, val)
        return leaf


class _OffloadingEntries(dict):
    """One op's cache in torch's SAC storage (torch >= 2.13: a dict of call index -> entry, with
    ``_RECOMPUTE`` for ops not saved); an entry stored after an offload decision goes to the tier."""

    def __init__(self, offloader: _Offloader) -> None:
        super().__init__()
        self.offloader = offloader

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, self.offloader(value))


class _OffloadingList(list):
    """The same for torches before 2.13, whose SAC storage keeps a list per op of the saved outputs
    alone (``append`` when saving, ``pop(0)`` when recomputing); found on torch 2.11 on a GPU."""

    def __init__(self, offloader: _Offloader) -> None:
        super().__init__()
        self.offloader = offloader

    def append(self, value: Any) -> None:
        super().append(self.offloader(value))


def _offload_as_save(policy: Callable[..., Any]) -> Callable[..., Any]:
    def replaying_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, op, *args, **kwargs)
        if not isinstance(decision, bool) and decision in _OFFLOAD_POLICIES:
            return _OFFLOAD_POLICIES[decision]
        return decision

    return replaying_policy


def _default_scope() -> Any:
    from .storage import boundary_offload, get_defaults

    defaults = get_defaults()
    scope = _default_scopes.get(defaults)
    if scope is None:
        _default_scopes.clear()
        scope = _default_scopes[defaults] = boundary_offload()
    return scope


_default_scopes: dict[Any, Any] = {}


def honour_offload(context_fn: ContextFn | None, scope: Any = None) -> ContextFn | None:
    """``context_fn`` with every random operator recomputed (``acshim.random_ops``: a saved one would
    leave the recompute's later draws off by one) and its policy's ``MUST_CPU_OFFLOAD`` /
    ``PREFER_CPU_OFFLOAD`` honoured in eager mode through acshim's storage tier (``scope``: a ``storage.boundary_offload(...)``; None
    = one shared scope built from ``storage.get_defaults()``). Each region call is one prefetch group.
    Contexts that are not torch's selective-checkpoint pair, and calls while torch.compile traces
    (where torch offloads itself), are left alone. Idempotent."""
    if context_fn is None or getattr(context_fn, "_acshim_offload", False):
        return context_fn

    def with_offload() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = context_fn()
        caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
        if caching is None or not isinstance(forward, caching) or torch.compiler.is_compiling():
            return forward, recompute  # (a compiled graph saves random operators' outputs: nothing draws again)
        _random_ops_recomputed(forward, recompute)
        if (not _OFFLOAD_POLICIES or not isinstance(getattr(forward, "storage", None), defaultdict)
                or forward.storage):
            return forward, recompute
        session = (scope if scope is not None else _default_scope()).session
        session.start_group()
        marker = _Marker()
        policy = forward.policy_fn

        def offloading_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy(ctx, op, *args, **kwargs)
            if not isinstance(decision, bool) and decision in _OFFLOAD_POLICIES:
                marker.offload_next = True
                return _OFFLOAD_POLICIES[decision]
            return decision

        forward.policy_fn = offloading_policy
        if getattr(recompute, "policy_fn", None) is policy:
            # torch before 2.13 asks the policy again when recomputing and replays only saved ops:
            # an offloaded output must be replayed from the tier, not recomputed beside it
            recompute.policy_fn = _offload_as_save(policy)
        layout = _OffloadingList if forward.storage.default_factory is list else _OffloadingEntries
        forward.storage.default_factory = functools.partial(layout, _Offloader(marker, session))
        return forward, _RecomputeChanged(recompute, forward.storage)

    with_offload._acshim_offload = True  # type: ignore[attr-defined]
    with_offload.__wrapped__ = context_fn  # type: ignore[attr-defined]
    with_offload._acshim_scope = scope  # type: ignore[attr-defined]
    return with_offload


def _random_ops_recomputed(forward: Any, recompute: Any) -> None:
    """The selective pair's policy made to recompute every operator that draws random numbers
    (``random_ops``), in the recompute too where torch asks it again (before 2.13)."""
    policy = forward.policy_fn
    guarded = recompute_random_ops(policy)
    forward.policy_fn = guarded
    if getattr(recompute, "policy_fn", None) is policy:
        recompute.policy_fn = guarded


def offload_tier(context_fn: ContextFn | None) -> str:
    """The storage tier (``"host"`` / ``"disk"``) that ``context_fn``'s offload decisions go to in an
    acshim region: its ``honour_offload`` scope's, else the shared default scope's."""
    scope = getattr(context_fn, "_acshim_scope", None)
    return (scope if scope is not None else _default_scope()).options.storage


class OffloadProbe(TorchDispatchMode):
    """Asks a selective-checkpoint policy about every operator of a forward run under it, as torch's
    caching mode does (torch/utils/checkpoint.py ``_CachingTorchDispatchMode``: once per operator
    output, ``SAC_IGNORED_OPS`` skipped), and keeps nothing: ``offloads`` becomes True when it answers
    ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``. The ``--budget`` planner runs a region's counting
    forward under it to learn whether the script's policy offloads (then the region runs as asked)."""

    def __init__(self, policy_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.offloads = False

    @classmethod
    def of(cls, context_fn: ContextFn | None) -> OffloadProbe | None:
        """A probe of ``context_fn``'s policy (an ``honour_offload`` wrapper is looked through; its
        own contexts are not made, so no offload group starts); None when ``context_fn`` does not make
        torch's selective-checkpoint pair, or torch has no offload policies."""
        while getattr(context_fn, "_acshim_offload", False):
            context_fn = context_fn.__wrapped__  # type: ignore[union-attr]
        caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
        if (context_fn is None or context_fn is torch_checkpoint.noop_context_fn or not _OFFLOAD_POLICIES
                or caching is None):
            return None
        forward, _ = context_fn()
        return cls(forward.policy_fn) if isinstance(forward, caching) else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _SAC_IGNORED_OPS:
            decision = self.policy_fn(_policy_context(out), func, *args, **kwargs)
            if not isinstance(decision, bool) and decision in _OFFLOAD_POLICIES:
                self.offloads = True
        return out


_SAC_IGNORED_OPS = getattr(torch_checkpoint, "SAC_IGNORED_OPS", frozenset())


def _policy_context(out: Any) -> Any:
    """torch's ``SelectiveCheckpointContext`` for a forward operator (``op_output`` where torch has it)."""
    context = torch_checkpoint.SelectiveCheckpointContext
    try:
        return context(is_recompute=False, op_output=out)
    except TypeError:  # torch before op_output
        return context(is_recompute=False)


def offload_policies(context_fn: ContextFn, storage: str | None = None, prefetch: int | None = None,
                     directory: str | None = None, min_bytes: int | None = None) -> ContextFn:
    """``context_fn`` whose offload decisions go to this storage tier (options of ``acshim.offload``;
    one prefetch schedule for every region using the returned function).

    >>> context_fn = offload_policies(lambda: create_selective_checkpoint_contexts(policy), storage="disk")
    >>> acshim.apply_checkpointing(model, context_fn=context_fn)
    """
    from .storage import boundary_offload

    wrapped = honour_offload(context_fn, boundary_offload(storage, prefetch, directory, min_bytes))
    assert wrapped is not None
    return wrapped

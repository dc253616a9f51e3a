"""One offload scope at work: the pack/unpack pair autograd calls, tiers, backends and the schedule.

``pack`` runs when autograd saves a tensor in forward: it decides whether the tensor moves (tier,
size floor, parameters and buffers stay), groups it, and issues its copy out when the schedule says
so; it returns a ``StoredTensor`` handle that autograd keeps. A tensor whose bytes are already
moving for another view of the same storage (q, k and v of one ``split``; the same tensor saved
twice) gets a ``StoredView`` of that handle instead: every storage byte moves once. ``unpack`` runs when backward needs it: it
issues the prefetch window, waits for this tensor's copy in (usually long finished) and rebuilds it
bit for bit. When autograd frees the handle, the tier space is released (on the ``reaper`` thread).
Bound methods, not closures in ``__init__`` (torchtune's weak spot): each step is testable alone.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends import Backend, TransferFailed, backend_for
from ..backends.base import Ticket, Tier
from . import unwind
from .errors import OffloadIOError
from .layout import Layout, from_bytes, movable, to_bytes, view_layout
from .observers import SESSION_OBSERVERS
from .reaper import REAPER
from .scheduler import PrefetchScheduler
from .thread_state import THREAD_STATE
from .versions import modified_error, version_probe

DEFAULT_BYTES_IN_FLIGHT = 256 << 20
"""Back-pressure: when the tier is slower than forward, at most this many bytes wait to be copied
out (still held where they were) before forward waits for the oldest copy. A tier may set its own
``max_bytes_in_flight`` (the disk tier keeps it small: freeing host memory is its whole point)."""


def opted_out() -> bool:
    """True inside ``no_offload()`` on this thread."""
    return THREAD_STATE.offload_opt_outs > 0


@dataclass(frozen=True)
class UnpackRecord:
    """One tensor brought back: its group, whether its copy had already landed, seconds waited."""

    group: int
    ready: bool
    waited: float


@dataclass
class OffloadStats:
    """What one offload scope did (also how facade tests show that routing happened)."""

    storage: str
    prefetch: int
    saved: int = 0
    """Tensors autograd saved inside the scope."""
    kept: int = 0
    """Of those, left where they were: host tier on CPU, under ``min_bytes``, parameters, opted out."""
    moved: int = 0
    moved_bytes: int = 0
    sent_out: int = 0
    """Copies out issued (moved tensors minus those still resident in the last H groups)."""
    fetched: int = 0
    late: int = 0
    """Unpacks whose copy in had not landed yet (backward waited)."""
    wait_seconds: float = 0.0
    unpacks: deque[UnpackRecord] = field(default_factory=lambda: deque(maxlen=4096))


class _Saved:
    """What every handle knows of the tensor autograd saved: its layout and its version."""

    __slots__ = ("layout", "version", "probe", "grad_fn_name", "source")

    def __init__(self, layout: Layout, tensor: torch.Tensor) -> None:
        self.layout = layout
        self.version = tensor._version
        self.probe = version_probe(tensor)
        """Shares the saved tensor's version counter, holds none of its memory: unpack compares
        ``version`` with it, also after the tensor itself is gone (see ``versions.version_probe``)."""
        self.grad_fn_name = _grad_fn_name_after_change(tensor)
        self.source = weakref.ref(tensor)
        """The saved tensor itself, weakly: torch's error text names it while it lives."""

    def modified(self) -> bool:
        """True if the saved tensor (or a view or base of it) was changed in place since it was saved."""
        if self.probe is not None:
            return self.probe._version != self.version
        source = self.source()
        return source is not None and source._version != self.version

    def modified_error(self) -> RuntimeError:
        """Torch's "modified by an inplace operation" error for this tensor."""
        source = self.source()
        if source is not None:
            return modified_error(source, self.version)
        return modified_error(self.probe, self.version, self.layout.shape, self.grad_fn_name)


class StoredTensor(_Saved):
    """What autograd keeps for a moved tensor: where its bytes are and how to rebuild it."""

    __slots__ = ("backend", "group", "data", "ready", "out", "incoming", "uses", "pending_uses", "kept", "slot",
                 "released", "__weakref__")

    def __init__(self, layout: Layout, backend: Backend, data: torch.Tensor, tensor: torch.Tensor) -> None:
        super().__init__(layout, tensor)
        self.backend = backend
        self.group = -1
        self.data: torch.Tensor | None = data
        """The bytes while resident (not sent out yet), or kept after a failed write."""
        self.ready: Any = backend.saved(data)
        """Where the bytes were produced (``Backend.saved``), until the copy out is issued."""
        self.out: Ticket | None = None
        self.incoming: Ticket | None = None
        self.uses = self.pending_uses = 1
        self.kept = False
        """``data`` is the backend's copy kept after a failed write (not the tensor autograd saved)."""
        self.slot: list[tuple[Backend, Ticket, Tier]] = []
        """The tier space to free, once (``release_slot``): by the reaper when autograd drops the
        handle, or at once when an exception unwinds its backward (``unwind``)."""
        self.released = False
        """Its bytes were released after an unwound backward: unpacking it is torch's freed error."""


def release_slot(slot: list[tuple[Backend, Ticket, Tier]]) -> None:
    """Free a handle's tier space if nobody has yet (``list.pop`` is atomic: the reaper thread and
    an unwound backward may both try)."""
    try:
        backend, ticket, tier = slot.pop()
    except IndexError:
        return
    backend.release(ticket, tier)


class StoredView(_Saved):
    """What autograd keeps for a tensor whose bytes move with another handle's (``owner``)."""

    __slots__ = ("owner",)

    def __init__(self, layout: Layout, owner: StoredTensor, tensor: torch.Tensor) -> None:
        super().__init__(layout, tensor)
        self.owner = owner


class OffloadSession:
    """Pack/unpack for one scope. ``per_tensor_groups``: each moved tensor is its own group
    (``offload()``); otherwise the owner calls ``start_group()`` per region (``boundary_offload``)."""

    PRUNE_SEEN_AT = 1024
    origin = "acshim"
    """The API that opened this scope (a facade's dialect), named by ``acshim run --report``."""

    def __init__(self, storage: str, prefetch: int, min_bytes: int, tier: Tier,
                 backend: Backend | None = None, per_tensor_groups: bool = True) -> None:
        self.storage = storage
        self.min_bytes = min_bytes
        self.tier = tier
        self.backend_override = backend
        self.per_tensor_groups = per_tensor_groups
        self.scheduler = PrefetchScheduler(prefetch)
        self.stats = OffloadStats(storage, prefetch)
        self._writing: deque[tuple[weakref.ref[StoredTensor], Backend, Ticket, int]] = deque()
        """Copies out not collected yet. Handles weakly: a graph dropped without backward (evaluation
        with grad on) frees its slots at once, not when a later pack collects its copies."""
        self._writing_bytes = 0
        self.max_bytes_in_flight: int = getattr(tier, "max_bytes_in_flight", DEFAULT_BYTES_IN_FLIGHT)
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[StoredTensor]]] = {}
        """id of a saved tensor's base (itself, or what it views) -> the handle moving its bytes."""
        self._prune_seen_at = self.PRUNE_SEEN_AT
        self._last: weakref.ref[StoredTensor] | None = None
        """The most recent handle moving bytes (see ``_already_moving``)."""
        self._lock = threading.RLock()
        self._handles: list[weakref.ref[StoredTensor]] = []
        """The moved tensors' handles (``release_unconsumed``), weakly. No ``WeakSet``: its weakref
        callbacks are Python code run as autograd frees handles, where a Ctrl-C is swallowed; dead
        entries are pruned here instead, amortized."""
        self._prune_handles_at = self.PRUNE_SEEN_AT
        unwind.ensure_installed()
        SESSION_OBSERVERS.notify(self)

    # ---------------------------------------------------------------------------------- forward

    def _backend_for(self, tensor: torch.Tensor) -> Backend | None:
        if self.backend_override is not None:
            if self.backend_override.handles(tensor):
                return self.backend_override
            if self.storage == "host" and tensor.device.type == "cpu":
                return None
        if self.storage == "host" and tensor.device.type == "cpu":
            return None  # already in host memory: keeping it is free and exact
        return backend_for(tensor.device)

    def pack(self, tensor: torch.Tensor) -> Any:
        """saved_tensors_hooks pack: a ``StoredTensor`` (or ``StoredView``) for a moved tensor, else
        ``(tensor, version)``."""
        with self._lock:
            self.stats.saved += 1
            backend = None if opted_out() or not movable(tensor, self.min_bytes) else self._backend_for(tensor)
            if backend is None:
                self.stats.kept += 1
                return tensor, tensor._version
            self.raise_write_errors(wait=False)
            shared = self._already_moving(tensor)
            if shared is not None:
                return shared
            data, layout = to_bytes(tensor)
            handle = StoredTensor(layout, backend, data, tensor)
            self._keep_handle(handle)
            self._remember(tensor, handle)
            self.stats.moved += 1
            self.stats.moved_bytes += layout.nbytes
            if self.per_tensor_groups:
                self.start_group()
            if self.scheduler.add(handle):
                self._send_out(handle)
            return handle

    def start_group(self) -> None:
        """Open the next group; send out the groups that left the resident window."""
        with self._lock:
            for handle in self.scheduler.start_group():
                self._send_out(handle)

    def _send_out(self, handle: StoredTensor) -> None:
        if handle.data is None or handle.out is not None:
            return
        handle.out = handle.backend.copy_out(handle.data, self.tier, handle.ready)
        handle.data = handle.ready = None
        handle.slot.append((handle.backend, handle.out, self.tier))
        REAPER.watch(handle, release_slot, handle.slot)
        self.scheduler.sent_out(handle)
        self._writing.append((weakref.ref(handle), handle.backend, handle.out, handle.layout.nbytes))
        self._writing_bytes += handle.layout.nbytes
        self.stats.sent_out += 1
        if self._over_limit():
            self.raise_write_errors(wait=False)

    def _over_limit(self) -> bool:
        """More bytes wait to be copied out than the oldest copy's backend lets wait."""
        if not self._writing:
            return False
        limit = self._writing[0][1].in_flight_limit(self.tier, self.max_bytes_in_flight)
        return limit is not None and self._writing_bytes > limit

    def _already_moving(self, tensor: torch.Tensor) -> StoredTensor | StoredView | None:
        """The handle for ``tensor`` if its bytes already move with an earlier save of the same
        storage, unchanged since: the same handle for the same tensor, a ``StoredView`` for another
        view of it. Two routes: a view of the same base (views share the base's version counter,
        so an equal version says the bytes are unchanged), or an alias of the storage the previous
        move came from (one op's outputs, saved one after the other: the outputs of ``split`` seen
        by a dispatch mode, where views carry no base and no shared counter)."""
        base = tensor._base if tensor._base is not None else tensor
        entry = self._seen.get(id(base))
        handle = entry[1]() if entry is not None and entry[0]() is base else None
        if handle is None or handle.version != tensor._version:
            handle = None if torch.compiler.is_compiling() else self._last_moved()  # no storages while tracing
            if handle is None or handle.modified() or not _same_storage(handle.source(), tensor):
                return None
        source = handle.source()
        if source is tensor or (source is not None and _same_view(source, tensor)):
            shared: StoredTensor | StoredView = handle
        else:
            layout = view_layout(tensor, handle.layout)
            if layout is None:
                return None
            shared = StoredView(layout, handle, tensor)
        handle.uses += 1
        handle.pending_uses += 1
        self.scheduler.regroup(handle, sent_out=handle.out is not None)
        return shared

    def _last_moved(self) -> StoredTensor | None:
        last = self._last
        return last() if last is not None else None

    def _keep_handle(self, handle: StoredTensor) -> None:
        handles = self._handles
        if len(handles) >= self._prune_handles_at:
            handles[:] = [ref for ref in handles if ref() is not None]
            self._prune_handles_at = max(self.PRUNE_SEEN_AT, 2 * len(handles))
        handles.append(weakref.ref(handle))

    def _remember(self, tensor: torch.Tensor, handle: StoredTensor) -> None:
        # No weakref callback drops dead entries: Python code run by the garbage collector swallows a
        # Ctrl-C landing in it. Entries of dead tensors are pruned here instead, amortized.
        seen = self._seen
        if len(seen) >= self._prune_seen_at:
            for key in [key for key, (ref, _) in seen.items() if ref() is None]:
                del seen[key]
            self._prune_seen_at = max(self.PRUNE_SEEN_AT, 2 * len(seen))
        base = tensor._base if tensor._base is not None else tensor
        seen[id(base)] = (weakref.ref(base), weakref.ref(handle))
        self._last = weakref.ref(handle)

    def raise_write_errors(self, wait: bool) -> None:
        """Collect finished copies out, waiting for the oldest while more than
        ``max_bytes_in_flight`` are pending (``wait``: for all of them); raise ``OffloadIOError`` if
        one failed. The failed tensor is kept in memory, so its graph still works."""
        failures: list[tuple[StoredTensor, TransferFailed]] = []
        writing = self._writing
        with self._lock:
            while writing and (wait or self._over_limit() or writing[0][1].done(writing[0][2])):
                ref, backend, ticket, nbytes = writing.popleft()
                self._writing_bytes -= nbytes
                try:
                    backend.wait(ticket)
                except TransferFailed as failure:
                    _drop_traceback(failure)
                    handle = ref()
                    if handle is None or handle.out is not ticket:  # its graph is gone, or unpack saw it
                        continue
                    handle.data, handle.out, handle.kept = failure.data, None, True
                    failures.append((handle, failure))
        if failures:
            handle, failure = failures[0]
            raise _io_error("writing", handle.layout.nbytes, len(failures), self.tier, failure.error)

    def forward_end(self) -> None:
        """The scope's forward is over: wait for the copies out that may fail (disk) and raise if one
        did. Copies that cannot fail (CUDA host tier) are not waited for: the device queue is not
        drained at the forward/backward boundary; they are collected later (next pack, or unpack)."""
        with self._lock:
            wait = any(backend.copy_out_can_fail(self.tier) for _, backend, _, _ in self._writing)
        self.raise_write_errors(wait=wait)

    # --------------------------------------------------------------------------------- backward

    def unpack(self, packed: Any) -> torch.Tensor:
        """saved_tensors_hooks unpack: the saved tensor, bitwise as it was saved; torch's own error
        if it was changed in place since (a copy made before the change would hide it)."""
        if type(packed) is tuple:
            tensor, version = packed
            if tensor._version != version:
                raise modified_error(tensor, version)
            return tensor
        if packed.modified():  # bytes a background copy read may postdate the change: never use them
            raise packed.modified_error()
        handle = packed.owner if type(packed) is StoredView else packed
        unwind.note(self)
        if handle.released:
            raise RuntimeError(unwind.FREED_ERROR)
        with self._lock:
            for due in self.scheduler.due_for_fetch(handle.group):
                self._fetch(due)
            if handle.data is None and handle.incoming is None:
                self.scheduler.record_fetch(handle, handle.group)
                self._fetch(handle)
        data = self._wait(handle)
        with self._lock:
            handle.pending_uses -= 1
            if handle.pending_uses == 0:  # every saver has it: drop the loaded copy
                handle.incoming, handle.pending_uses = None, handle.uses
        return from_bytes(data, packed.layout)

    def release_unconsumed(self) -> None:
        """An exception unwound a backward that read from this scope (``unwind``): free the tier
        space, prefetched copies and resident bytes of every saved tensor its graph still holds.
        A copy in flight is waited for first: its slot must not be reused under it."""
        with self._lock:
            handles = [handle for handle in (ref() for ref in self._handles) if handle is not None]
            for handle in handles:
                if handle.released:
                    continue
                handle.released = True
                handle.data = handle.ready = None
                incoming, handle.incoming = handle.incoming, None
                if incoming is not None:
                    try:
                        handle.backend.wait(incoming)
                    except Exception:  # its bytes are dropped either way; a Ctrl-C here still propagates
                        pass
                release_slot(handle.slot)
        REAPER.settle_pending()  # handles autograd freed just before: their slots too
        close = getattr(self.tier, "close", None)
        if close is not None:  # the disk tier's current file, empty now: closed, not kept for a next step
            close()

    def _fetch(self, handle: StoredTensor) -> None:
        if handle.released:
            return
        if handle.data is None and handle.incoming is None and handle.out is not None:
            handle.incoming = handle.backend.copy_in(handle.out, self.tier)
            self.stats.fetched += 1

    def _wait(self, handle: StoredTensor) -> torch.Tensor:
        if handle.data is not None:
            if handle.kept:  # made by the backend after a failed write: tie it to this consumer stream
                handle.backend.kept_used(handle.data)
            self.stats.unpacks.append(UnpackRecord(handle.group, True, 0.0))
            return handle.data
        ticket = handle.incoming
        start = time.perf_counter()
        try:
            ready = handle.backend.done(ticket)
            data = handle.backend.wait(ticket)
        except TransferFailed as failure:
            _drop_traceback(failure)
            handle.data, handle.out, handle.incoming, handle.kept = failure.data, None, None, True
            raise _io_error("writing", handle.layout.nbytes, 1, self.tier, failure.error) from failure.error
        except OSError as error:
            handle.incoming = None
            if isinstance(error, OffloadIOError):
                raise
            raise _io_error("reading back", handle.layout.nbytes, 1, self.tier, error) from error
        waited = time.perf_counter() - start
        self.stats.unpacks.append(UnpackRecord(handle.group, ready, waited))
        self.stats.late += not ready
        self.stats.wait_seconds += waited
        return data


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """``a`` is alive and shares ``b``'s storage (alive, so its storage's identity is not reused)."""
    return a is not None and a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, strides and offset (of one storage): the same bytes, read the same way."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def _grad_fn_name_after_change(tensor: torch.Tensor) -> str | None:
    """The node torch's error would name for ``tensor`` once changed in place: its own, except for
    a differentiable view, whose node torch regenerates as an ``as_strided`` of its changed base."""
    if tensor.grad_fn is None:
        return None
    if tensor._base is not None:
        return "AsStridedBackward0"
    return tensor.grad_fn.name()


def _drop_traceback(failure: TransferFailed) -> None:
    # The failure object lives on in its future, which the reaper keeps for the handle's release;
    # re-raising it here attached our frame (holding handles) to it: a cycle through the reaper's
    # registry that would keep the handles, their files and their tensors alive forever.
    failure.with_traceback(None)


def _io_error(action: str, nbytes: int, count: int, tier: Tier, error: OSError) -> OffloadIOError:
    where = getattr(tier, "directory", None)
    place = f"the disk tier in {where!r}" if where else f"the {tier.kind} tier"
    more = f" (and {count - 1} more)" if count > 1 else ""
    hint = ("free space there, pass directory= on a larger disk, or use storage='host'" if where
            else "check host memory")
    preposition = "to" if action == "writing" else "from"
    return OffloadIOError(error.errno, f"acshim offload: {action} a saved tensor of {nbytes} bytes{more} {preposition} {place} "
                          f"failed: {error.strerror or error}. The tensor is kept in memory, nothing computed is "
                          f"lost; {hint}.")

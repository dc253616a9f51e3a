"""The public offload scopes: ``offload()`` around a forward, ``boundary_offload()`` for regions,
``no_offload()`` to opt one region out, and ``recording()`` to see what they did."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from torch.autograd.graph import saved_tensors_hooks

from ..backends import Backend
from . import native
from .defaults import check_directory_argument, check_flag, get_defaults, validate
from .disk import DiskTier, check_directory
from .errors import OffloadIOError
from .host import HostTier
from .observers import SESSION_OBSERVERS
from .offload_session import OffloadSession, OffloadStats
from .residents import BUFFERS
from .thread_state import THREAD_STATE
from .versions import keep, unpack_kept


class OffloadOptions:
    """Offload options with the engine defaults (``set_defaults``) filled in and validated."""

    def __init__(self, storage: str | None, prefetch: int | None, directory: str | None, min_bytes: int | None,
                 direct: bool | None, native_io: bool | None, backend: Backend | None) -> None:
        check_flag("direct", direct, "None: O_DIRECT where the filesystem allows it")
        check_flag("native", native_io, "None: the C++ extension if it builds, else the Python path")
        if backend is not None and not isinstance(backend, Backend):
            raise TypeError(f"backend must be an acshim.backends.Backend or None, got {backend!r}")
        if directory is not None:
            check_directory_argument(directory)
        defaults = get_defaults()
        self.storage = defaults.storage if storage is None else storage
        self.prefetch = defaults.prefetch if prefetch is None else prefetch
        self.min_bytes = defaults.min_bytes if min_bytes is None else min_bytes
        self.directory = defaults.directory if directory is None else directory
        self.direct, self.native, self.backend = direct, native_io, backend
        validate(self.storage, self.prefetch, self.min_bytes)
        if self.storage == "disk":
            check_directory(self.directory)

    def tier(self) -> HostTier | DiskTier:
        if self.storage == "host":
            return HostTier()
        return DiskTier(native.file_io(self.native), self.directory, self.direct)

    def session(self, tier: Any, per_tensor_groups: bool) -> OffloadSession:
        return OffloadSession(self.storage, self.prefetch, self.min_bytes, tier, self.backend, per_tensor_groups)


class OffloadActivations:
    """Context manager under which every tensor saved for backward goes to a storage tier after
    forward and comes back, prefetched, before backward needs it. Gradients are bitwise unchanged.

    Mirrors ``torch.autograd.graph.save_on_cpu`` and torchtune's ``OffloadActivations`` (scope:
    everything autograd saves inside the block; inside a non-reentrant checkpoint only the region's
    boundary inputs reach it, as with torch). Better than both: CPU tensors on the host tier stay put
    at no cost (``save_on_cpu`` copies them), backward prefetches H tensors ahead instead of waiting
    for each copy, and a disk tier exists.

    Args:
        storage (str): ``"host"`` (default from ``set_defaults``, built in ``"host"``): device tensors
            go to pinned host memory over a side stream; CPU tensors stay where they are (free).
            ``"disk"``: tensors go to private files, bypassing the page cache: frees host memory at
            the price of disk bandwidth in backward.
        prefetch (int): horizon H (default 2). Each saved tensor is one group here: the last H stay
            resident, and backward brings back H ahead. Larger hides slower transfers and holds more
            memory; 0 sends everything out and waits for every copy in backward.
        directory (str | None): disk tier only: where its private files go (a fresh 0700 directory,
            files unlinked at once so even a killed process leaves nothing). Default: ``$TMPDIR``.
        min_bytes (int): size floor (default 1024): smaller tensors stay put; moving tiny tensors
            costs more in latency than it saves in memory.
        direct (bool | None): disk tier: ``None`` uses ``O_DIRECT`` where the filesystem allows it,
            ``False`` always writes through the page cache and drops it (``posix_fadvise``).
        native (bool | None): disk tier I/O engine: ``None`` the C++ extension if it builds (else the
            Python path after one warning), ``False`` the Python path, ``True`` require the extension.
        backend (Backend | None): override the transfer backend for every tensor (tests, benchmarks:
            ``acshim.backends.SimulatedBackend``); default picks by the tensor's device.

    Raises:
        ValueError: unknown ``storage``, negative ``prefetch``/``min_bytes``, or a ``directory`` that
            is not a writable directory.
        OffloadIOError: (an ``OSError``, errno kept) a disk write or read failed, e.g. the disk is
            full; raised in the step where it happened, at the latest when the block exits; the
            tensor concerned is kept in memory.
        RuntimeError: in backward, torch's own "modified by an inplace operation" error when a saved
            tensor was changed in place after forward (torch skips that check under hooks; this
            scope does it, whether the tensor stayed, moved or was already fetched back).

    Example:
        >>> with acshim.offload(storage="disk", prefetch=2):
        >>>     loss = model(inputs).sum()
        >>> loss.backward()
    """

    origin = "acshim.offload"
    """The API this scope stands for, named by ``acshim run --report`` (facades set their dialect)."""

    def __init__(self, storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
                 min_bytes: int | None = None, *, direct: bool | None = None, native: bool | None = None,
                 backend: Backend | None = None) -> None:
        self.options = OffloadOptions(storage, prefetch, directory, min_bytes, direct, native, backend)
        self._tier = self.options.tier()
        self._active: list[tuple[OffloadSession, saved_tensors_hooks]] = []
        self.session: OffloadSession | None = None
        """The most recent block's session (its ``stats`` say what moved)."""

    @property
    def stats(self) -> OffloadStats | None:
        """What the most recent block did."""
        return self.session.stats if self.session else None

    def __enter__(self) -> OffloadActivations:
        session = self.options.session(self._tier, per_tensor_groups=True)
        session.origin = self.origin
        hooks = saved_tensors_hooks(session.pack, session.unpack)
        BUFFERS.enter()  # note the buffers of the modules this forward calls: they stay
        try:
            hooks.__enter__()
        except BaseException:
            BUFFERS.exit()
            raise
        self._active.append((session, hooks))
        self.session = session
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        session, hooks = self._active.pop()
        try:
            hooks.__exit__(exc_type, exc, traceback)
        finally:
            BUFFERS.exit()
        if exc_type is None:
            session.forward_end()
            return
        finish_after_failure(session, exc)


def finish_after_failure(session: OffloadSession, exc: BaseException | None) -> None:
    """Forward failed: let its copies out finish (so their files are freed with the graph), keeping
    the user's exception the one raised. A failed write is dropped (its tensor is kept in memory); any
    other error met while waiting (a CUDA error: maybe the failure's own cause, reported again) is
    attached to the user's exception as a note."""
    try:
        session.forward_end()
    except Exception as error:  # whatever it is, the forward's own error is the one to see
        if exc is not None and not isinstance(error, OffloadIOError):
            exc.add_note(f"acshim offload: while waiting for this forward's copies after the error: "
                         f"{type(error).__name__}: {error}")


def offload(storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
            min_bytes: int | None = None, *, direct: bool | None = None, native: bool | None = None,
            backend: Backend | None = None) -> OffloadActivations:
    """``acshim.offload(...)``: see ``OffloadActivations`` for every option.

    >>> with acshim.offload(storage="disk"):
    >>>     loss = model(inputs).sum()
    >>> loss.backward()
    """
    return OffloadActivations(storage, prefetch, directory, min_bytes, direct=direct, native=native,
                              backend=backend)


class no_offload:
    """Keep every tensor saved inside this block where it is, even inside an enclosing ``offload()``
    or a region with ``boundary_offload`` (torchtune's ``NoOpManager``, extended to both scopes).

    >>> with acshim.offload(storage="disk"):
    >>>     with acshim.storage.no_offload():
    >>>         x = attention(x)        # stays in memory
    """

    def __init__(self) -> None:
        self._hooks = saved_tensors_hooks(keep, unpack_kept)  # torch's in-place check, kept

    def __enter__(self) -> no_offload:
        THREAD_STATE.offload_opt_outs += 1
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)
        THREAD_STATE.offload_opt_outs -= 1


class _RegionScope:
    """The ``saved_tensors_hooks`` context of one region call: a new group of the shared session."""

    def __init__(self, session: OffloadSession) -> None:
        self.session = session
        self.hooks = saved_tensors_hooks(session.pack, session.unpack)

    def __enter__(self) -> None:
        self.session.start_group()
        self.hooks.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.hooks.__exit__(*exc_info)


class BoundaryOffload:
    """Offload the boundary inputs of checkpointed regions (DeepSpeed ``checkpoint_in_cpu``,
    FairScale ``offload_to_cpu``, SMP ``offload_activations``). Use one instance for all the regions
    of a model, as ``RegionOptions.saved_tensors_scope``: each region call is one group, so backward
    prefetches the inputs of the next H regions while it recomputes this one, and the last H
    regions' inputs never leave. Options as ``OffloadActivations``.

    >>> scope = acshim.storage.boundary_offload(storage="host", prefetch=2)
    >>> acshim.apply_checkpointing(model, saved_tensors_scope=scope)
    >>> model(inputs).sum().backward()
    """

    def __init__(self, storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
                 min_bytes: int | None = None, *, direct: bool | None = None, native: bool | None = None,
                 backend: Backend | None = None) -> None:
        self.options = OffloadOptions(storage, prefetch, directory, min_bytes, direct, native, backend)
        self.session = self.options.session(self.options.tier(), per_tensor_groups=False)

    def __call__(self) -> _RegionScope:
        return _RegionScope(self.session)

    @property
    def stats(self) -> OffloadStats:
        return self.session.stats

    def __reduce__(self) -> tuple[Any, ...]:
        # Deep copies and pickles of a checkpointed model get a fresh scheduler with the same options.
        o = self.options
        return (_rebuild_boundary, (o.storage, o.prefetch, o.directory, o.min_bytes, o.direct, o.native))

    def __repr__(self) -> str:
        o = self.options
        return f"BoundaryOffload(storage={o.storage!r}, prefetch={o.prefetch}, min_bytes={o.min_bytes})"


def _rebuild_boundary(storage: str, prefetch: int, directory: str | None, min_bytes: int,
                      direct: bool | None, native_io: bool | None) -> BoundaryOffload:
    return BoundaryOffload(storage, prefetch, directory, min_bytes, direct=direct, native=native_io)


def boundary_offload(storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
                     min_bytes: int | None = None, *, direct: bool | None = None, native: bool | None = None,
                     backend: Backend | None = None) -> BoundaryOffload:
    """A ``BoundaryOffload`` for ``RegionOptions.saved_tensors_scope`` (options of ``offload``)."""
    return BoundaryOffload(storage, prefetch, directory, min_bytes, direct=direct, native=native, backend=backend)


def region_option_changes(storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
                          min_bytes: int | None = None) -> dict[str, Any]:
    """``RegionOptions`` changes that offload every region's boundary inputs: ``{}`` when
    ``storage`` is None (no offload), else ``{"saved_tensors_scope": boundary_offload(...)}``.
    Call once per model so all its regions share one prefetch schedule."""
    if storage is None:
        return {}
    return {"saved_tensors_scope": boundary_offload(storage, prefetch, directory, min_bytes)}


@contextlib.contextmanager
def recording() -> Iterator[list[OffloadSession]]:
    """Collect every offload session started inside the block (their ``stats`` show what was
    routed where). Facade tests use it to prove that a flag reached the engine."""
    sessions: list[OffloadSession] = []
    SESSION_OBSERVERS.add(sessions.append)
    try:
        yield sessions
    finally:
        SESSION_OBSERVERS.remove(sessions.append)

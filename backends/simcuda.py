"""A simulated CUDA runtime that checks stream ordering on a CPU: the proof the CUDA backend gets here.

``CudaBackend(torch.device("cpu"), runtime=SimulatedCuda())`` runs the real backend code on CPU
tensors standing for device memory. The simulator keeps CUDA's ordering rules and reports, or
poisons, every use that real hardware would be free to get wrong:

- **Streams are queues of deferred copies.** ``copy`` only enqueues. Work runs when something
  orders it: a host ``synchronize`` (or a ``query`` that found it done), or compute that waits for
  it. With ``order="lazy"`` nothing runs earlier (a GPU as late as allowed); with ``order="random"``
  runnable copies also run at random moments (as early as allowed, in any order the graph allows).
- **Events and waits form a happens-before graph** (vector clocks): ``record`` snapshots what its
  stream has been ordered after, ``wait_event`` adds it to a stream, a host ``synchronize`` adds it
  to the host (work issued after a host sync is ordered after what the host saw finish).
- **Compute is eager.** Under ``compute()`` (a ``TorchDispatchMode``) every torch op is an op of the
  current stream that runs at once: first everything that stream was ordered after runs, then the
  op. Reading bytes whose last writer is not ordered before the reader is a violation and the
  reader gets NaN (0xFF bytes): a missing ``wait_event`` turns into a wrong gradient. A copy that
  writes bytes an earlier copy on another stream may still be reading (not ordered after it) is a
  violation too ("overwritten while read"; the writer's bytes are poisoned).
- **Device memory follows the caching allocator's rule**: memory used on a stream other than the one
  it was allocated on (or produced on) must be ``record_stream``-ed for that stream if it is freed
  while that use may still be pending, unless its own stream was made to wait for that use before
  the free (a stream-ordered free: the next allocation on that stream comes after the use). A copy whose source the program freed without it reads NaN.
- **The caching allocator's pools** (issue 27): each ``empty`` takes the best-fitting free range of
  its stream's segments (split; freed ranges coalesce) or reserves a new segment of its size (the
  real allocator's 2 MiB / 20 MiB segment rounding is not modelled: a constant per stream); a freed
  block returns to its stream's segments at once, unless it was
  ``record_stream``-ed: then only once the *host* has seen the work its free-time events stand for
  finish (a synchronisation or a query that found it done). The device is modelled as running behind
  the host by as much as the ordering allows (in lazy order, a whole backward): nothing is seen
  finished that the host did not wait for. ``reserved_bytes``/``peak_reserved_bytes`` are what
  ``torch.cuda.max_memory_reserved()`` would report for the memory the backend allocates.
- **Host memory**: ``pin`` is page-locked (asynchronous copies); memory marked ``pageable`` makes a
  copy synchronous (the host waits for it, as CUDA does); ``record_stream`` on host memory raises, as
  torch does for a CPU tensor. ``unpin`` of memory not pinned, or while a queued copy may still use
  it, is a violation.
- **Devices**: every call on a thread other than the one that built the simulator must come under
  ``device()`` (a worker thread starts on device 0: CUDA would create a context there); ``pin``
  records the device current at registration (``pinned_on``).
- **Graph capture**: inside ``capture()``, ``is_capturing`` is True and host synchronisation,
  ``query`` and ``pin``/``unpin`` raise, as CUDA's stream capture does.
- **Pinned memory is counted** (allocations and bytes) for the pool's tests.
- **Autograd nodes run on their forward op's stream**, as torch's engine runs them on a GPU: the
  backward of an op made while a side stream was current runs with that stream current (after it
  waited for the stream its gradient came from), and the outer stream waits for it afterwards.
- **Timed mode** (``timing=BandwidthModel()``, ``backends/simtime.py``): every copy and kernel gets a
  duration from a bandwidth model and a place on a virtual clock per stream; the host has a clock
  too (launch costs, waits). ``synchronize`` moves the host's clock to the device's, ``query`` and
  the allocator's reuse of ``record_stream``-ed blocks answer by virtual time, pageable copies make
  the host wait their (slower) duration, ``Event.elapsed_time`` reads the clocks; ``timeline``
  reports host waits, compute-stream idle time and stalls, and copy/compute overlap.

Violations are collected in ``violations``; tests assert it stays empty. The latency-only
``SimulatedBackend`` (``simulated.py``) stays for latency-only overlap tests without streams.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .simtime import BandwidthModel, Timeline, op_flops, tensor_bytes

PAGE = 4096
POISON = 0xFF
"""Bytes of memory read out of order (0xFF..: NaN in every float dtype)."""

Clock = dict[int, int]
"""A vector clock: stream id -> position of the last op ordered before."""


def _merge(into: Clock, other: Clock) -> None:
    for stream, position in other.items():
        if into.get(stream, 0) < position:
            into[stream] = position


def _covers(clock: Clock, stream: int, position: int) -> bool:
    return clock.get(stream, 0) >= position


@dataclass(frozen=True)
class Violation:
    """One ordering rule broken: ``kind`` and what happened."""

    kind: str
    detail: str


@dataclass
class _Op:
    stream: SimStream
    position: int
    clock: Clock
    run: Callable[[], None] | None
    writes: list[tuple[int, int, int]]
    """(storage, start byte, end byte) ranges written (poisoned instead when ``poisoned``)."""
    holds: list[torch.Tensor]
    """Tensors the op reads or writes (the simulator's references: released once it ran)."""
    reads: list[tuple[int, int, int]]
    description: str
    poisoned: bool = False


@dataclass
class _Storage:
    """What the simulator knows of one storage (kept alive by a weak reference: a stable key)."""

    key: int
    owner: int | None
    """Stream it was allocated (or produced) on; None for pinned host memory (not the allocator's)."""
    writes: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(start, end, stream, position) of writes not superseded."""
    reads: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(start, end, stream, position) of the latest copies reading it (a later write must follow them)."""
    uses: list[tuple[int, int]] = field(default_factory=list)
    """(stream, position) of uses on streams other than ``owner``."""
    recorded: set[int] = field(default_factory=set)
    held: int = 0
    """Tensors on this storage held by pending ops."""
    freed: bool = False


class SimStream:
    """A simulated stream: ``wait_event``, ``wait_stream``, ``synchronize``, ``query``."""

    def __init__(self, sim: SimulatedCuda, name: str, device: int = 0) -> None:
        self.sim, self.name, self.device = sim, name, device
        self.id = len(sim._streams) + 1
        self.issued = 0
        self.executed = 0
        self.after: Clock = {}
        """What the next op on this stream is ordered after (its waits)."""
        self.queue: deque[_Op] = deque()
        sim._streams[self.id] = self

    def wait_event(self, event: SimEvent) -> None:
        with self.sim._api("wait_event"):
            if event.clock is not None:
                _merge(self.after, event.clock)

    def wait_stream(self, stream: SimStream) -> None:
        event = self.sim.Event()
        event.record(stream)
        self.wait_event(event)

    def synchronize(self) -> None:
        with self.sim._api("stream.synchronize", capturable=False):
            clock = self.sim._snapshot(self)
            self.sim._host_sync(clock, f"{self.name}.synchronize")

    def query(self) -> bool:
        with self.sim._api("stream.query", capturable=False):
            return self.sim._query(self.sim._snapshot(self))

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    """A simulated event: ``record``, ``synchronize``, ``query``."""

    def __init__(self, sim: SimulatedCuda) -> None:
        self.sim = sim
        self.clock: Clock | None = None
        self.at = 0.0
        """Timed mode: when the event completes (its work's end, or the host's record time if later)."""

    def record(self, stream: SimStream | None = None) -> None:
        with self.sim._api("event.record"):
            self.clock = self.sim._snapshot(stream if stream is not None else self.sim._current())
            timeline = self.sim.timeline
            if timeline is not None:
                self.at = max(timeline.host, timeline.time_of(self.clock))

    def synchronize(self) -> None:
        with self.sim._api("event.synchronize", capturable=False):
            if self.sim.fail_synchronize is not None:
                raise self.sim.fail_synchronize
            if self.clock is not None:
                self.sim._host_sync(self.clock, "event.synchronize")

    def query(self) -> bool:
        with self.sim._api("event.query", capturable=False):
            return self.clock is None or self.sim._query(self.clock)

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds of virtual time from this event to ``end`` (timed mode only, as CUDA's
        ``elapsed_time`` needs timing events)."""
        timeline = self.sim.timeline
        if timeline is None or self.clock is None or end.clock is None:
            raise RuntimeError("elapsed_time needs a timed simulator (timing=BandwidthModel()) and two recorded events")
        return (end.at - self.at) * 1e3


class SimulatedCuda:
    """The runtime ``CudaBackend`` takes (see ``backends/runtime.py``), on CPU, with ordering checks.

    Args:
        order: ``"lazy"`` (deferred work runs only when something waits for it) or ``"random"``
            (it may also run at any moment the ordering allows).
        seed: for ``"random"``.
        early: in ``"random"`` order, the chance, at each call, of running one more runnable op.
        timing: a ``BandwidthModel`` (``backends/simtime.py``) to run a virtual clock per stream and
            one for the host: each op then lasts what the model says, ``query`` and the allocator
            answer by virtual time, host waits advance the host clock (``timeline``). None: no time.
    """

    def __init__(self, order: str = "lazy", seed: int = 0, early: float = 0.5,
                 timing: BandwidthModel | None = None) -> None:
        if order not in ("lazy", "random"):
            raise ValueError(f"order must be 'lazy' or 'random', got {order!r}")
        self.order, self.early = order, early
        self._random = random.Random(seed)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams: dict[int, SimStream] = {}
        self._storages: dict[int, _Storage] = {}
        self._watched: dict[int, _Storage] = {}
        """Storages used on a stream other than their owner and not yet freed."""
        self._host: Clock = {}
        self.default_stream = SimStream(self, "default")
        self.violations: list[Violation] = []
        self.pinned_allocations = 0
        self.pinned_bytes = 0
        self.pending_out_bytes = 0
        """Bytes of device -> host copies issued that the host has not seen finish (device memory a
        real GPU still holds for them while the host runs ahead: what back-pressure must bound)."""
        self.peak_pending_out_bytes = 0
        self._outs: deque[tuple[int, int, int]] = deque()
        self.blocks: dict[int, tuple[int, Any]] = {}
        """Caching allocator: storage key -> (stream id, block) of live ``empty`` blocks."""
        self._pools: dict[int, list[list[list[int]]]] = {}
        """Per stream: its segments, each ``[[size], [offset, length] of each free range...]``."""
        self._deferred: list[tuple[Any, Clock]] = []
        """Blocks freed after ``record_stream``: (block, free-time positions the host must see done)."""
        self.reserved_bytes = self.peak_reserved_bytes = 0
        self.allocated_bytes = self.peak_allocated_bytes = 0
        self._owner_thread = threading.get_ident()
        self._capturing = 0
        self.pinned_on: list[int] = []
        """The current device at each ``pin``."""
        self._pinned: set[int] = set()
        self._pageable: set[int] = set()
        self.synchronized_by: dict[str, int] = {}
        """Host synchronisations (event or stream) that had to wait for unfinished work, per thread name."""
        self.timeline = Timeline(timing) if timing is not None else None
        """Virtual time (timed mode): host clock, per-stream op ends, host waits, stalls."""
        self.fail_synchronize: BaseException | None = None
        """Set to make every ``Event.synchronize`` raise it (a CUDA error, for error-path tests)."""

    # ------------------------------------------------------------------------ the runtime API

    def Stream(self, device: Any = None) -> SimStream:
        with self._api("Stream"):
            return SimStream(self, f"side{len(self._streams)}", _index(device, self._device()))

    def Event(self) -> SimEvent:
        return SimEvent(self)

    def current_stream(self, device: Any = None) -> SimStream:
        return self._current()

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[SimStream]:
        stack = self._stack()
        stack.append(stream)
        try:
            with self.device(stream.device):  # torch.cuda.stream() makes the stream's device current
                yield stream
        finally:
            stack.pop()

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        """``torch.cuda.device(device)``: the calling thread's current device inside the block."""
        local = self._local
        outer = getattr(local, "device", None)
        local.device = _index(device, 0)
        try:
            yield
        finally:
            local.device = outer

    def _device(self) -> int:
        device = getattr(self._local, "device", None)
        return 0 if device is None else device

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Stream capture (``torch.cuda.graph``) on every stream while inside (this simulator)."""
        self._capturing += 1
        try:
            yield
        finally:
            self._capturing -= 1

    def is_capturing(self, device: Any = None) -> bool:
        return self._capturing > 0

    def is_device_tensor(self, tensor: torch.Tensor, device: Any = None) -> bool:
        """Simulated device memory: any tensor but pinned or ``pageable`` host memory."""
        key = tensor.untyped_storage()._cdata
        return key not in self._pinned and key not in self._pageable

    def pageable(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``tensor`` as ordinary (pageable) host memory: copies from or to it are synchronous."""
        with self._api("pageable"):
            self._storage(tensor, owner=None)
            self._pageable.add(tensor.untyped_storage()._cdata)
            return tensor

    def pin(self, nbytes: int) -> torch.Tensor:
        with self._api("pin", capturable=False):
            self.pinned_allocations += 1
            self.pinned_bytes += nbytes
            self.pinned_on.append(self._device())
            raw = torch.full((nbytes + PAGE,), POISON, dtype=torch.uint8)
            self._storage(raw, owner=None)
            self._pinned.add(raw.untyped_storage()._cdata)
            shift = -raw.data_ptr() % PAGE
            return raw[shift:shift + nbytes]  # page-aligned, as cudaHostRegister-ed mappings are

    def unpin(self, tensor: torch.Tensor) -> None:
        with self._api("unpin", capturable=False):
            key = tensor.untyped_storage()._cdata
            if key not in self._pinned:
                self._violate("unpin", "unregistering memory that is not registered")
                return
            if self._storages[key].held:  # a queued copy still reads or writes it
                self._violate("unpinned while in use", "unregistering pinned memory a queued copy may still use")
            self._pinned.discard(key)
            self.pinned_bytes -= tensor.numel()

    def empty(self, nbytes: int, device: Any = None) -> torch.Tensor:
        with self._api("empty"):
            stream = self._current()
            tensor = torch.full((nbytes,), POISON, dtype=torch.uint8)  # never-written memory reads as NaN
            state = self._storage(tensor, owner=stream.id)
            self.blocks[state.key] = (stream.id, self._allocate(stream.id, nbytes))
            return tensor

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        with self._api("record_stream"):
            if not self.is_device_tensor(tensor):
                raise RuntimeError("record_stream: expected a CUDA tensor, got host memory (torch raises here too)")
            self._storage(tensor, owner=self.default_stream.id).recorded.add(stream.id)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source, non_blocking=True)`` on the current stream: deferred."""
        with self._api("copy"):
            stream = self._current()
            reads = [self._range(source, default_owner=self.default_stream.id)]
            writes = [self._range(destination, default_owner=stream.id)]
            op = self._issue(stream, lambda: destination.copy_(source), reads, writes, [destination, source],
                             f"copy {source.numel()} B on {stream.name}")
            keys = (reads[0][0], writes[0][0])
            pageable = any(key in self._pageable for key in keys)
            if self.timeline is not None:
                kind = "pageable" if pageable else "pinned" if any(key in self._pinned for key in keys) else "device"
                seconds = self.timeline.model.copy_seconds(source.numel() * source.element_size(), kind)
                self.timeline.schedule(stream.id, op.position, op.clock, seconds)
            if pageable:  # not pinned: synchronous
                self._host_sync(self._snapshot(stream), f"pageable copy on {stream.name}")
            if self._storages[writes[0][0]].owner is None and self._storages[reads[0][0]].owner is not None:
                self._outs.append((stream.id, op.position, source.numel()))  # device -> pinned host
                self.pending_out_bytes += source.numel()
                self.peak_pending_out_bytes = max(self.peak_pending_out_bytes, self.pending_out_bytes)

    # ---------------------------------------------------------------------- compute (eager ops)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Every torch op run inside (on this thread) is eager compute on the current stream; the
        backward of an op made on a side stream runs on that stream (``_AutogradStreams``)."""
        depth = len(self._stack())
        try:
            with _ComputeMode(self), _AutogradStreams(self):
                yield
        finally:  # a backward that raised inside a side-stream node never ran the hook that pops it
            del self._stack()[depth:]

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        """Inside ``compute()``: ops run here are plain CPU ops, neither ordered nor checked (a
        reference run with no GPU semantics)."""
        local = self._local
        outer = getattr(local, "busy", False)
        local.busy = True
        try:
            yield
        finally:
            local.busy = outer

    def _compute(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        schema = func._schema
        views_only = all(r.alias_info is not None for r in schema.returns) and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if views_only:  # metadata only: no bytes are read or written
            return func(*args, **kwargs)
        with self._api("compute"):
            stream = self._current()
            clock = dict(stream.after)
            _merge(clock, self._host)
            self._run_clock(clock)
            self._run_until(stream, stream.issued)
            stream.issued += 1
            stream.executed = stream.issued
            position = stream.issued
            clock[stream.id] = position - 1
            depends = dict(clock)
            mutated = _mutated(schema, args, kwargs)
            flat, spec = tree_flatten((args, kwargs))
            for index, value in enumerate(flat):
                if isinstance(value, torch.Tensor) and value.numel():
                    problem = self._unordered_read(self._range(value, None, create=False), clock, stream)
                    self._note_use(value, stream, position)
                    if problem is not None:
                        self._violate("read before written", f"{func} on {stream.name} reads {problem}")
                        if not any(value is m for m in mutated):
                            flat[index] = _poisoned(value)
            args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        with self._api("compute-out"):
            written = list(mutated)
            returns = out if isinstance(out, (tuple, list)) else (out,)
            for result, info in zip(returns, schema.returns):
                if info.alias_info is None and isinstance(result, torch.Tensor):
                    written.append(result)
            for tensor in written:
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    key, start, end = self._range(tensor, default_owner=stream.id)
                    self._write(self._storages[key], start, end, stream.id, position)
            if self.timeline is not None:
                moved = tensor_bytes(flat) + tensor_bytes(list(returns))
                seconds = self.timeline.model.kernel_seconds(moved, op_flops(func, args, kwargs, out))
                self.timeline.schedule(stream.id, position, depends, seconds)
        return out

    # ------------------------------------------------------------------------------ reports

    def is_device_memory(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is simulated device memory (not pinned host memory)."""
        with self._api("is_device_memory"):
            state = self._storage(tensor, None, create=False)
            return state is not None and state.owner is not None

    def check(self) -> list[Violation]:
        """Look for storages freed while a use on another stream may be pending; the violations."""
        with self._api("check"):
            pass
        return self.violations

    def drain(self) -> None:
        """Run every pending op (the end of a test: a real GPU finishes its queues too)."""
        with self._api("drain"):
            for stream in list(self._streams.values()):
                self._run_until(stream, stream.issued)

    # ---------------------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _api(self, name: str, capturable: bool = True) -> Iterator[None]:
        local = self._local
        outer = getattr(local, "busy", False)
        if not capturable and self._capturing:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({name})")
        if not outer and threading.get_ident() != self._owner_thread and getattr(local, "device", None) is None:
            self._violate("no device guard", f"{name} on thread {threading.current_thread().name}, which never set "
                          "a device: CUDA makes device 0 current there (a context on GPU 0 for every rank)")
        with self._lock:
            local.busy = True
            try:
                if not outer:
                    self._poll()
                    if self.order == "random":
                        while self._random.random() < self.early and self._run_random():
                            pass
                yield
            finally:
                local.busy = outer

    def busy(self) -> bool:
        return getattr(self._local, "busy", False)

    def _stack(self) -> list[SimStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _current(self) -> SimStream:
        stack = self._stack()
        return stack[-1] if stack else self.default_stream

    def _snapshot(self, stream: SimStream) -> Clock:
        clock = dict(stream.after)
        _merge(clock, self._host)
        clock[stream.id] = max(clock.get(stream.id, 0), stream.issued)
        return clock

    def _storage(self, tensor: torch.Tensor, owner: int | None, create: bool = True) -> _Storage | None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        state = self._storages.get(key)
        if state is None and create:
            storage._weak_ref()  # keeps the StorageImpl (not its bytes) allocated: the key stays unique
            state = self._storages[key] = _Storage(key, owner)
            if len(self._storages) % 4096 == 0:
                self._prune()
        return state

    def _range(self, tensor: torch.Tensor, default_owner: int | None,
               create: bool = True) -> tuple[int, int, int] | None:
        state = self._storage(tensor, default_owner, create)
        if state is None:
            return None
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
        return state.key, start, start + span * size

    def _allocate(self, stream: int, nbytes: int) -> tuple[list[list[int]], int, int]:
        """The caching allocator: the best-fitting free range of ``stream``'s segments (split), or a
        new segment of the request's size (512-byte granularity). Returns (segment, offset, size)."""
        size = max(512, -(-nbytes // 512) * 512)
        self._collect_deferred()
        segments = self._pools.setdefault(stream, [])
        best: tuple[int, list[list[int]], int] | None = None
        best_length = 0
        for segment in segments:
            for index, (offset, length) in enumerate(segment[1:]):
                if length >= size and (best is None or length < best_length):
                    best, best_length = (index + 1, segment, offset), length
        if best is None:
            segment = [[size], [0, size]]  # [[segment size], free ranges [offset, length]...]
            segments.append(segment)
            self.reserved_bytes += size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            best = (1, segment, 0)
        index, segment, offset = best
        length = segment[index][1]
        if length > size:
            segment[index] = [offset + size, length - size]
        else:
            del segment[index]
        self.allocated_bytes += size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return segment, offset, size

    @staticmethod
    def _give_back(block: tuple[list[list[int]], int, int]) -> None:
        segment, offset, size = block
        free = segment[1:]
        free.append([offset, size])
        free.sort()
        merged: list[list[int]] = []
        for start, length in free:  # coalesce neighbours, as the allocator does
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += length
            else:
                merged.append([start, length])
        segment[1:] = merged

    def _collect_deferred(self) -> None:
        still = []
        timeline = self.timeline
        for block, clock in self._deferred:
            if timeline.done(clock) if timeline is not None else \
                    all(_covers(self._host, other, position) for other, position in clock.items()):
                self._give_back(block)
            else:
                still.append((block, clock))
        self._deferred = still

    def _free_blocks(self) -> None:
        for key, (stream, block) in list(self.blocks.items()):
            state = self._storages[key]
            if not self._freed_by_program(state):
                continue
            del self.blocks[key]
            self.allocated_bytes -= block[2]
            recorded = {other: self._streams[other].issued for other in state.recorded if other != stream}
            if recorded:  # free-time events on the recorded streams: reusable once seen done
                self._deferred.append((block, recorded))
            else:
                self._give_back(block)

    def _prune(self) -> None:
        for key in [key for key, state in self._storages.items()
                    if torch.UntypedStorage._expired(key) and key not in self._watched and not state.held
                    and key not in self.blocks]:
            del self._storages[key]
            self._pinned.discard(key)
            self._pageable.discard(key)
            torch.UntypedStorage._free_weak_ref(key)

    def _issue(self, stream: SimStream, run: Callable[[], None], reads: list[Any], writes: list[Any],
               holds: list[torch.Tensor], description: str) -> _Op:
        stream.issued += 1
        clock = dict(stream.after)
        _merge(clock, self._host)
        clock[stream.id] = stream.issued - 1
        op = _Op(stream, stream.issued, clock, run, writes, holds, reads, description)
        for key, start, end in reads:
            problem = self._unordered_read((key, start, end), clock, stream)
            if problem is not None:
                op.poisoned = True
                self._violate("read before written", f"{description} reads {problem}")
            self._note_use_key(key, stream, op.position)
            read_by = self._storages[key].reads
            read_by.append((start, end, stream.id, op.position))
            del read_by[:-64]
        for key, start, end in writes:
            state = self._storages[key]
            for r_start, r_end, r_stream, r_position in state.reads:
                if r_start < end and start < r_end and r_stream != stream.id and not _covers(clock, r_stream, r_position):
                    op.poisoned = True
                    self._violate("overwritten while read", f"{description} writes bytes [{start}, {end}) that op "
                                  f"{r_position} of {self._streams[r_stream].name} may still be reading")
                    break
            self._write(state, start, end, stream.id, op.position)
            self._note_use_key(key, stream, op.position)
        for tensor in holds:
            self._storages[tensor.untyped_storage()._cdata].held += 1
        stream.queue.append(op)
        return op

    def _unordered_read(self, span: tuple[int, int, int] | None, clock: Clock, stream: SimStream) -> str | None:
        if span is None:
            return None
        key, start, end = span
        state = self._storages.get(key)
        if state is None:
            return None
        for w_start, w_end, w_stream, w_position in state.writes:
            if w_start < end and start < w_end and not _covers(clock, w_stream, w_position):
                writer = self._streams[w_stream].name
                return f"bytes [{start}, {end}) written by op {w_position} of {writer}, not ordered before it"
        return None

    def _write(self, state: _Storage, start: int, end: int, stream: int, position: int) -> None:
        state.writes = [w for w in state.writes if not (start <= w[0] and w[1] <= end)]
        state.writes.append((start, end, stream, position))

    def _note_use(self, tensor: torch.Tensor, stream: SimStream, position: int) -> None:
        state = self._storage(tensor, None, create=False)
        if state is not None:
            self._note_use_key(state.key, stream, position)

    def _note_use_key(self, key: int, stream: SimStream, position: int) -> None:
        state = self._storages[key]
        if state.owner is not None and state.owner != stream.id and not state.freed:
            state.uses.append((stream.id, position))
            self._watched[key] = state

    def _freed_by_program(self, state: _Storage) -> bool:
        return torch._C._storage_Use_Count(state.key) <= state.held

    def _poll(self) -> None:
        """Storages the program freed: was each use on another stream finished or recorded?"""
        self._free_blocks()
        for key, state in list(self._watched.items()):
            if not self._freed_by_program(state):
                continue
            state.freed = True
            del self._watched[key]
            owner = self._streams[state.owner].after  # freed in stream order: the owner waited for the use
            for stream, position in state.uses:
                if stream not in state.recorded and not _covers(self._host, stream, position) \
                        and not _covers(owner, stream, position):
                    name = self._streams[stream].name
                    self._violate("freed while in use", f"memory owned by {self._name(state.owner)} freed while op "
                                  f"{position} of {name} may still use it, and no record_stream({name})")
                    break

    def _name(self, stream: int | None) -> str:
        return self._streams[stream].name if stream is not None else "host"

    def _violate(self, kind: str, detail: str) -> None:
        self.violations.append(Violation(kind, detail))

    def _run_clock(self, clock: Clock) -> None:
        for stream, position in list(clock.items()):
            self._run_until(self._streams[stream], position)

    def _run_until(self, stream: SimStream, position: int) -> None:
        while stream.executed < position and stream.queue:
            op = stream.queue[0]
            for other, other_position in list(op.clock.items()):
                if other != stream.id:
                    self._run_until(self._streams[other], other_position)
            stream.queue.popleft()
            self._execute(op)
            stream.executed = op.position
        if stream.executed < position:  # positions of eager compute ops: already run
            stream.executed = min(position, stream.issued)

    def _execute(self, op: _Op) -> None:
        for key, _, _ in op.reads:
            state = self._storages[key]
            foreign = state.owner is not None and op.stream.id != state.owner
            if foreign and op.stream.id not in state.recorded and self._freed_by_program(state):
                op.poisoned = True
                self._violate("freed while in use", f"{op.description}: the program freed its source (owned by "
                              f"{self._name(state.owner)}) before it ran, and no record_stream({op.stream.name})")
        if op.poisoned:
            op.holds[0].fill_(POISON)  # the destination: a 1-D uint8 buffer
        elif op.run is not None:
            op.run()
        for tensor in op.holds:
            self._storages[tensor.untyped_storage()._cdata].held -= 1
        op.holds.clear()
        op.run = None

    def _query(self, clock: Clock) -> bool:
        if self.timeline is not None:  # done once the host's virtual clock has passed its end
            done = self.timeline.done(clock)
            if done:
                self._run_clock(clock)
        else:
            done = all(self._streams[stream].executed >= position for stream, position in clock.items())
        if done:
            self._host_saw(clock)
        return done

    def _host_sync(self, clock: Clock, what: str = "synchronize") -> None:
        if self.timeline is not None:
            blocked = not self.timeline.done(clock)
            if blocked and threading.get_ident() == self._owner_thread:  # a worker's wait is not the host's
                self.timeline.wait(clock, what)
        else:
            blocked = not all(self._streams[stream].executed >= position for stream, position in clock.items())
        if blocked:
            name = threading.current_thread().name  # a wait for work not done yet: the host blocks
            self.synchronized_by[name] = self.synchronized_by.get(name, 0) + 1
        self._run_clock(clock)
        self._host_saw(clock)

    def _host_saw(self, clock: Clock) -> None:
        _merge(self._host, clock)
        outs = self._outs
        for entry in [entry for entry in outs if _covers(self._host, entry[0], entry[1])]:
            outs.remove(entry)
            self.pending_out_bytes -= entry[2]

    def _run_random(self) -> bool:
        runnable = [s for s in self._streams.values() if s.queue and all(
            self._streams[other].executed >= position for other, position in s.queue[0].clock.items()
            if other != s.id)]
        if not runnable:
            return False
        stream = self._random.choice(runnable)
        op = stream.queue.popleft()
        self._execute(op)
        stream.executed = op.position
        return True


def _index(device: Any, default: int) -> int:
    if device is None:
        return default
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.type == "cuda" and device.index is not None else 0


class _ComputeMode(TorchDispatchMode):
    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.sim.busy():
            return func(*args, **kwargs)
        return self.sim._compute(func, args, kwargs)


class _AutogradStreams(TorchFunctionMode):
    """Autograd nodes run on their forward op's stream, as torch's engine runs them on a GPU: a node
    made while a side stream was current gets a pre-hook that makes that stream current for its
    backward (after waiting for the stream its incoming gradient was made on, the engine's
    input-buffer sync) and a hook that restores the outer stream and makes it wait for the node's
    (the engine syncs the consumer of a gradient with its producer). Nodes made on the default stream
    run on the stream current when backward runs (the default one in the tests)."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        sim = self.sim
        stream = sim._current()
        if stream is sim.default_stream or not torch.is_grad_enabled() or sim.busy():
            return out
        for value in tree_flatten(out)[0]:
            node = value.grad_fn if isinstance(value, torch.Tensor) else None
            if node is not None and "acshim_sim_stream" not in node.metadata:
                node.metadata["acshim_sim_stream"] = stream
                node.register_prehook(functools.partial(_enter_node_stream, sim, stream))
                node.register_hook(functools.partial(_leave_node_stream, sim, stream))
        return out


def _enter_node_stream(sim: SimulatedCuda, stream: SimStream, grad_outputs: Any) -> None:
    stream.wait_stream(sim._current())
    sim._stack().append(stream)


def _leave_node_stream(sim: SimulatedCuda, stream: SimStream, grad_inputs: Any, grad_outputs: Any) -> None:
    stack = sim._stack()
    if stack and stack[-1] is stream:
        stack.pop()
    sim._current().wait_stream(stream)


def _mutated(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def _poisoned(tensor: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_like(tensor)
    if copy.is_floating_point() or copy.is_complex():
        return copy.fill_(float("nan"))
    return copy.fill_(-1) if copy.dtype != torch.bool else copy.fill_(True)

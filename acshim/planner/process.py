"""The memory a budget is about: what the process holds, as the operating system or the device sees it.

A tracker of tensor storages (``tracker.LiveBytes``) predicts activation memory; what a user has is
the process's memory: on CPU its anonymous resident memory (``/proc/self/statm``: resident less
file-backed pages), on a CUDA device the bytes its caching allocator has reserved
(``torch.cuda.memory_reserved``; fragmentation counts, as it does for an out-of-memory error).
Storage tier buffers, copies in flight, worker threads' stacks and heaps, Python objects and
allocator slack are all in it, and none of them is a tensor storage. File-backed pages are not in
that reading: library code paged in on the first use of an operator, and weights a loader mapped
from their file (``safetensors`` maps a frozen base model; a fine-tuning step pages 16-41 MiB of a
tiny Llama and code in during its first forward). They are the same with or without a plan, so no
measurement of a choice is charged for them, but ``VmHWM`` counts them and they stay resident: what
was paged in since the step's start (``file_backed``) counts against a guard's limit
(``Guard.file_baseline``) and is charged once to the plan by the session.

``ProcessMemory`` reads that number cheaply (one ``pread`` of ``statm``); ``Guard`` samples it after
every operator of the thread it is entered on and raises ``OverBudget`` as soon as the process is
above its limit, so planning never runs past a budget it is planning for. Sampling after operators
sees what other threads allocated in between (a disk tier's read buffers) at the next operator;
an operator's own scratch memory, freed before it returns, is the one thing it cannot see.
Written by hand: neither the CPU allocator nor the profiler reports process memory (docs/measuring.md),
and ``VmHWM`` can only be reset for the whole process (``/proc/self/clear_refs``), which would wipe
the user's own high-water mark.

On a CUDA device the caching allocator keeps freed blocks for reuse, so ``memory_reserved`` does not
fall when tensors are freed. ``trim()`` gives those cached blocks back (``empty_cache``) wherever a
measurement starts, as it gives the heap's free pages back on CPU, so that one measurement does not
start with the last one's cache; and the guard charges an operator's outputs only beyond what the
cache can serve (``ProcessMemory.reusable``: reserved less allocated), since an output that fits in
freed blocks adds nothing to reserved memory. ``acshim run --budget`` also sets the allocator's
``expandable_segments`` (``acshim.allocator``), so that reserved memory follows allocated memory.

On CPU under ``acshim run --budget``, acshim's own tensor allocator (``acshim.host_allocator``) keeps
freed blocks mapped once the plan runs, never more than its tensors held at most since it was last
emptied: ``current()`` leaves those cached bytes out (what tensors can take again without the process
growing), and ``trim()`` empties the cache and resets that bound, so a measurement starting after it
peaks where it would with a mapping per tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import host_allocator
from .pages import uncommitted

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096



MEMORY_KINDS = ("process", "tensors")
"""What a budget is measured against: ``process`` (the process's memory, as above: the default) or
``tensors`` (activation tensor storages as ``tracker.LiveBytes`` counts them; no guard)."""


def check_memory_kind(memory: object) -> None:
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS} (what the budget is measured against), got {memory!r}")


GUARD_MARGIN = (0.05, 4 << 20, 0.01)
"""How far below the budget the guard stops a measurement (``guard_limit``): a share of the budget
(5%), at most a number of bytes (4 MiB), and at least a smaller share (1%). Room for what the guard
cannot see before it is there: an operator's own scratch memory freed before it returns, and what
other threads allocate while it runs (the storage tier's reads landing, Python's object arenas,
which are mapped outside malloc's heap). Stopped measurements of a GPT-2 block went 1.2-3.1 MiB past
the guard on this machine under load, so a 1% margin let the planning step of a 45 MiB budget peak
5% over it; on budgets of hundreds of MiB and more, that much is within 1% of them."""


def guard_limit(budget: int) -> int:
    """Where the guard stops measurements under ``budget`` bytes (``GUARD_MARGIN``)."""
    share, most, least_share = GUARD_MARGIN
    return int(budget - max(least_share * budget, min(share * budget, most)))


def guarded_budget(needed: int) -> int:
    """The least budget whose guard lets a measurement reach ``needed`` bytes (``guard_limit``'s
    inverse: it grows with the budget)."""
    share, most, least_share = GUARD_MARGIN
    budget = math.ceil(needed / (1 - share))
    if share * budget > most:
        budget = needed + most
        if least_share * budget > most:
            budget = math.ceil(needed / (1 - least_share))
    while guard_limit(budget) < needed:  # rounding
        budget += 1
    return budget


class OverBudget(RuntimeError):
    """The process went above a guard's limit while planning measured something."""

    def __init__(self, used: int, limit: int, what: str, operator: str = "", size: int = 0) -> None:
        super().__init__(f"{what}: the process held {used} bytes above the step's start, over the limit {limit}")
        self.used, self.limit, self.what = used, limit, what
        self.operator, self.size = operator, size
        """The operator stopped before it ran and the bytes of its outputs (where it was sized)."""


class BackwardDrain:
    """Frees what a backward stopped by an exception left queued in torch's autograd engine. On CPU
    the engine runs a backward on the calling thread from a thread-local ready queue; when a node
    raises (the guard's ``OverBudget``), the nodes already queued stay in that queue, each holding
    its node, hence the stopped graph's saved tensors (a checkpoint's recomputed ones included),
    until a later backward on the thread happens to pop them. Measured: a GPT-2 block's stopped
    ``recompute`` measurement kept 19.7 MiB (its recomputed tensors) until a later step's backward,
    so the next measurement, ``offload:disk``, started there and was stopped too: a budget of 50 MiB
    was refused naming 50.1 MiB, which was refused naming 50.2 MiB; with the drain it plans.

    A backward pops stale nodes only until its own graph is done, and the queue serves nodes with
    higher sequence numbers (newer) first. So the drain's graph is made once per thread before any
    measurement (``prepare``, when a guard is made), its one node older than every node a
    measurement makes, and run with ``retain_graph`` each time: every stale node is popped before
    it. Written by hand: torch has no call that clears the queue."""

    _local = threading.local()

    @classmethod
    def prepare(cls) -> None:
        """Make this thread's drain graph (once): call before the graphs it is to drain are made."""
        if getattr(cls._local, "graph", None) is None:
            with torch.enable_grad():
                leaf = torch.zeros((), requires_grad=True)
                # the gradient given, and clone's backward passing it on: no operator runs, so a
                # guard still entered (a stop inside the counting forward) has nothing to stop
                cls._local.graph = (leaf, leaf.clone(), torch.ones(()))

    @classmethod
    def run(cls) -> None:
        """Pop and discard every node a stopped backward left in this thread's queue."""
        graph = getattr(cls._local, "graph", None)
        if graph is None:
            cls.prepare()
            return
        leaf, output, gradient = graph
        torch.autograd.grad(output, leaf, gradient, retain_graph=True)


def release_stopped(error: BaseException) -> None:
    """Free what a measurement stopped by ``error`` (an ``OverBudget``) held: the locals of the frames
    it unwound (the step's loss and outputs, hence its autograd graph and saved tensors). Needed
    because raised from inside torch's autograd engine, the stopped backward's Python frames stay
    referenced from C++ after the exception is caught (the frame of ``_engine_run_backward`` and its
    callers: no Python object refers to them, so ``gc`` neither sees nor collects them), and with
    them the whole graph: the next measurement then started holding the stopped one's peak and was
    stopped at once (a GPT-2 block's 35 MiB, in about half of the runs under load), and the process
    went over the budget while it settled. ``traceback.clear_frames`` drops those frames' locals
    (frames still running, the catcher's own, are left as they are); then ``BackwardDrain`` frees the
    nodes the stopped backward left queued."""
    traceback.clear_frames(error.__traceback__)
    BackwardDrain.run()


class ProcessMemory:
    """Bytes the process holds on ``device``: anonymous resident memory on CPU (Linux
    ``/proc/self/statm``: resident less shared, i.e. file-backed, pages), reserved by the caching
    allocator on CUDA. ``available`` is False where neither can be read
    (then ``current()`` is 0 and guards never trip: the tracker's prediction is all there is)."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True) -> None:
        self.device = torch.device(device)
        self._fd: int | None = None
        self._lock = threading.Lock()
        if not enabled:
            self.available = False
        elif self.device.type == "cuda":
            self.available = True
        else:
            try:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
                self.available = True
            except OSError:
                self.available = False

    def current(self) -> int:
        return self.read()[0]

    def read(self) -> tuple[int, int]:
        """``(current(), file_backed())`` from one read of ``statm``: the guard needs both after
        every operator (it read the file three times an operator before; not timed apart)."""
        if not self.available:
            return 0, 0
        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device)), 0
        if self._fd is None:
            return 0, 0
        with self._lock:  # one shared descriptor; pread has no file position to race on, the lock is cheap
            fields = os.pread(self._fd, 128, 0).split()
        # resident less file-backed, less the freed blocks acshim's allocator keeps (the module docstring)
        return (int(fields[1]) - int(fields[2])) * _PAGE - host_allocator.cached(), int(fields[2]) * _PAGE

    def file_backed(self) -> int:
        """Bytes of file-backed (and shared) pages resident on CPU (``statm``'s shared field): library
        code paged in on an operator's first use, files mapped. ``current()`` leaves them out; a step
        that pages code in after its start holds them for the rest of the run, and ``VmHWM`` counts
        them (the session charges that growth once, ``PlanSession._paged_in``). 0 on a CUDA device
        and where statm cannot be read."""
        return self.read()[1] if self.device.type == "cpu" else 0

    def reusable(self) -> int:
        """Bytes new tensors can take without raising ``current()``: on a CUDA device, the blocks the
        caching allocator has reserved and tensors do not hold (an upper bound: a block too small
        for a request is not used for it); 0 on CPU, where freed heap memory is given back (``trim``)
        before every measurement."""
        if not self.available or self.device.type != "cuda":
            return 0
        return max(0, int(torch.cuda.memory_reserved(self.device)) - int(torch.cuda.memory_allocated(self.device)))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


_TRIM: Any = None


def trim() -> None:
    """Give the heap's free memory back to the operating system (glibc ``malloc_trim(0)``; a no-op
    elsewhere), and the CUDA caching allocator's free blocks back to the device where CUDA has
    started (``torch.cuda.empty_cache``), and acshim's CPU allocator's cache (``host_allocator.release``),
    so a baseline read next is not inflated by memory already freed. Called where a measurement
    starts, never in a planned step."""
    global _TRIM
    host_allocator.release()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


class Guard(TorchDispatchMode):
    """Samples the process's memory after every operator on this thread (and on ``sample()``): the
    ``peak`` above ``baseline`` is recorded, and an operator that would take the process above
    ``limit`` is not run: its caller gets ``OverBudget`` (raised from the operator, so forward and
    backward unwind at once). An operator whose outputs could take the process over the limit (it
    is within the largest rise seen so far, or twice the operator's largest input, of it; or the
    operator can make outputs larger than its inputs: a matmul, a factory, a concatenation) first has
    its outputs sized on the meta device (shape inference, nothing allocated) and is stopped before
    it allocates them; the others are checked by the sample after them. Outputs that the CUDA
    caching allocator's free blocks can hold (``ProcessMemory.reusable``) are not charged before
    they run: they may add nothing, and the sample after them sees what they did add. ``what``
    names the measurement for the error (``open_window``); ``limit=None`` only records."""

    def __init__(self, memory: ProcessMemory, baseline: int, limit: int | Callable[[], int] | None = None,
                 file_baseline: int | None = None) -> None:
        super().__init__()
        self.memory, self.baseline, self.limit = memory, baseline, limit
        """Bytes, or a function giving them at each check (a limit that grows with what is learnt)."""
        self.file_baseline = file_baseline
        """File-backed pages resident at the step's start (``ProcessMemory.file_backed``), or None:
        code paged in since counts against the limit (``VmHWM`` counts it), never as a measurement's
        own bytes (``used``, ``peak``: it is charged once, by the session)."""
        self.peak = 0
        self.what = "planning"
        self.window_peak = 0
        self.last = 0
        self.largest_step = 0
        """The largest rise of the process's memory across one operator seen so far."""
        self._file_backed: int | None = None
        """File-backed bytes at the last sample (``current_limit``)."""
        self.own_seconds = 0.0
        """Time spent in this guard's checks and samples (a step's wall time less it is what the step
        takes unguarded: a plan with more operators pays more of it)."""
        BackwardDrain.prepare()  # before the graphs of the measurements this guard may stop

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as tracker.LiveBytes: no Dynamo import, no wrapper per operator

    def used(self) -> int:
        return self.memory.current() - self.baseline

    def sample(self) -> int:
        current, self._file_backed = self.memory.read()
        used = current - self.baseline
        self.peak = max(self.peak, used)
        self.window_peak = max(self.window_peak, used)
        self.last = used
        limit = self.current_limit()
        if limit is not None and used > limit:
            raise OverBudget(used, limit, self.what)
        return used

    def current_limit(self) -> int | None:
        """The limit on ``used()``: the budget's, less the code paged in since the step's start (as
        of the last sample, which is as fresh as ``last``)."""
        limit = self.limit() if callable(self.limit) else self.limit
        if limit is None or self.file_baseline is None:
            return limit
        file_backed = self.memory.file_backed() if self._file_backed is None else self._file_backed
        return limit - max(0, file_backed - self.file_baseline)

    def open_window(self, what: str) -> None:
        """Start a measurement named ``what``: free heap memory goes back to the system (with glibc's
        default settings freed tensors stay in the heap, and the resident set would carry the last
        measurement's high-water mark into this one), and ``window_peak`` restarts from what the
        process holds now."""
        trim()
        self.what = what
        self.window_peak = self.last = self.used()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_view(func):  # allocates nothing: the next operator's sample sees what other threads did
            return func(*args, **kwargs)
        entered = time.perf_counter()
        limit = self.current_limit()
        if limit is not None and (self.last + max(self.largest_step, 2 * _largest_input(args, kwargs)) > limit
                                  or _may_grow(func)):
            size = 0 if uncommitted(func, args, kwargs) else _product_bytes(func, args)
            if size is None:
                size = _output_bytes(func, args, kwargs)
            if size is not None:
                after = self.used() + max(0, size - self.memory.reusable())
                if after > limit:
                    raise OverBudget(after, limit, self.what, str(func), size)
        before = self.last
        started = time.perf_counter()
        out = func(*args, **kwargs)
        finished = time.perf_counter()
        self.largest_step = max(self.largest_step, self.sample() - before)
        self.own_seconds += (started - entered) + (time.perf_counter() - finished)
        return out


_GROWING = frozenset((
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "tensordot", "outer", "kron", "embedding",
    "cat", "stack", "repeat", "repeat_interleave", "expand_copy", "index_select", "gather", "_unsafe_index",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "_to_copy", "cdist",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_attention_math", "one_hot", "pad", "constant_pad_nd", "upsample_nearest2d",
    "upsample_bilinear2d"))
"""Operators whose outputs can be larger than twice their largest input (checked on the meta device)."""


_UNANNOTATED_VIEWS = frozenset(("_unsafe_view",))
"""Views whose schema carries no alias annotation (``aten::_unsafe_view``: the reshape after a matmul
of 3-d inputs returns the matmul's own storage). Sized as new outputs, a language model's logits were
counted twice: 31 MiB of a LoRA Llama's 32k vocabulary stopped planning at budgets it fits."""


@functools.cache
def _may_grow(func: Any) -> bool:
    name = getattr(func, "_opname", None) or getattr(getattr(func, "_schema", None), "name", "").split("::")[-1]
    if name in _GROWING:
        return True
    schema = getattr(func, "_schema", None)  # factories (empty, zeros, full, arange, randn): no tensor inputs
    return schema is not None and not any(str(a.type).startswith("Tensor") for a in schema.arguments)


@functools.cache
def _is_view(func: Any) -> bool:
    """Whether every output of ``func`` aliases an input (views, in-place and ``out=`` operators)."""
    returns = getattr(getattr(func, "_schema", None), "returns", None)
    return bool(returns) and all(r.alias_info is not None for r in returns)


_PRODUCTS = {"mm": (0, 1, None), "addmm": (1, 2, None), "bmm": (0, 1, 0), "baddbmm": (1, 2, 1)}
"""Matrix products (the operators a model runs most that can grow memory): argument positions of the
left and right operands and of the batch dimension's source, to size their output from shapes."""


def _product_bytes(func: Any, args: Any) -> int | None:
    """Bytes of a matrix product's output from its operands' shapes, without shape inference on the
    meta device (a tenth of a GPT-2 step under the guard); None for other operators."""
    positions = _PRODUCTS.get(getattr(func, "_opname", ""))
    if positions is None or getattr(func, "_overloadname", "") != "default":
        return None
    left, right, batch = positions
    a, b = args[left], args[right]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
        return None
    count = a.shape[-2] * b.shape[-1] * (args[batch].shape[0] if batch is not None else 1)
    return count * a.element_size()


def _largest_input(args: Any, kwargs: Any) -> int:
    """Bytes of the largest tensor among an operator's arguments. By hand, not with pytree: called
    for every operator while planning, and an ATen operator's arguments are tensors, scalars or
    one level of lists (pytree's generic walk cost a tenth of a second per GPT-2 step)."""
    largest = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            largest = max(largest, value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    largest = max(largest, item.numel() * item.element_size())
    return largest


def _output_bytes(func: Any, args: Any, kwargs: Any) -> int | None:
    """Bytes of the tensors ``func`` would return, from shape inference on the meta device; None if
    the operator has no meta implementation (the sample after it is the check then)."""
    returns = getattr(getattr(func, "_schema", None), "returns", None)
    if returns is not None and all(r.alias_info is not None for r in returns):
        return 0  # views and in-place operators allocate nothing
    if getattr(func, "_opname", None) in _UNANNOTATED_VIEWS:
        return 0
    try:
        out = func(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
    except Exception:  # no meta kernel, or one that needs real data
        return None
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    aliased = [r.alias_info is not None for r in returns] if returns is not None else []
    return sum(leaf.untyped_storage().nbytes() for i, leaf in enumerate(leaves)
               if isinstance(leaf, torch.Tensor) and not (i < len(aliased) and aliased[i]))


def _meta(value: Any) -> Any:
    """An operator argument with its tensors on the meta device (one level of lists, as ATen's)."""
    if isinstance(value, torch.Tensor):
        return value.to("meta") if value.device.type != "meta" else value
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(_meta(item) for item in value)
    return value

"""A backward unwound by an exception releases what the storage tier holds for its graph.

Autograd keeps a graph's saved tensors until the graph is dropped. A backward stopped by an
exception (Ctrl-C landing in a tensor hook, an error raised by a node) leaves them with the graph,
and the script may hold that graph on for long: a loss kept for logging, the exception's traceback
(a notebook keeps the last one), a retry loop. For tensors in memory that is torch's behaviour; for
the storage tier it is tier space nothing will read again: blocks of an unlinked file, pinned host
memory, copies already prefetched.

So every backward runs inside a frame: torch's one Python entry into its engine,
``torch.autograd.graph._engine_run_backward`` (which ``Tensor.backward``, ``autograd.backward`` and
``autograd.grad`` all call), is wrapped while any offload session exists. Sessions note themselves
in the frames of the backwards they unpack for, and when such a call ends in an exception without
``retain_graph``, each noted session releases every saved tensor it has not handed back in full
(``OffloadSession.release_unconsumed``). Unpacking one later gives torch's own error for freed saved
tensors, as a second backward through a graph does. With ``retain_graph=True`` nothing is released:
the caller may run backward again. Hand-written because autograd has no hook for a backward that
fails; torch wraps the same function the same way for ``make_fx`` tracing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.graph as autograd_graph

FREED_ERROR = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward."
)
"""torch's error for a saved tensor whose graph's buffers were freed (torch 2.x wording)."""


class _Frame:
    """One backward call in progress: the offload sessions it unpacked from."""

    __slots__ = ("sessions",)

    def __init__(self) -> None:
        self.sessions: dict[int, Any] = {}


_local = threading.local()
_frames_lock = threading.Lock()
_all_frames: list[_Frame] = []
_lock = threading.Lock()
_original: Callable[..., Any] | None = None


def note(session: Any) -> None:
    """Called by a session's unpack: the backwards running now read from ``session``. Autograd runs
    an accelerator's nodes on its own threads: with no backward started on this thread, every
    backward in flight is credited."""
    frames = getattr(_local, "frames", None)
    if not frames:
        with _frames_lock:
            frames = list(_all_frames)
    for frame in frames:
        frame.sessions.setdefault(id(session), session)


def _keeps_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # torch calls run_backward(outputs, grad_outputs, keep_graph, create_graph, inputs, ...)
    keep = args[1] if len(args) > 1 else kwargs.get("keep_graph", kwargs.get("retain_graph"))
    return bool(keep)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        frame = _Frame()
        frames = getattr(_local, "frames", None)
        if frames is None:
            frames = _local.frames = []
        frames.append(frame)
        with _frames_lock:
            _all_frames.append(frame)
        try:
            return original(t_outputs, *args, **kwargs)
        except BaseException:
            if frame.sessions and not _keeps_graph(args, kwargs):
                for session in frame.sessions.values():
                    session.release_unconsumed()
            raise
        finally:
            frames.remove(frame)
            with _frames_lock:
                _all_frames.remove(frame)

    run_backward.__acshim_unwind__ = original  # type: ignore[attr-defined]
    return run_backward


def ensure_installed() -> None:
    """Wrap torch's backward entry (idempotent; ``restore`` undoes it)."""
    global _original
    with _lock:
        if _original is not None:
            return
        current = autograd_graph._engine_run_backward
        if hasattr(current, "__acshim_unwind__"):
            return
        _original = current
        wrapped = _wrap(current)
        autograd_graph._engine_run_backward = wrapped
        if torch.autograd._engine_run_backward is current:  # the name torch.autograd's callers read
            torch.autograd._engine_run_backward = wrapped


def restore() -> None:
    """Put torch's backward entry back (``acshim.uninstall()``); backwards started before keep the
    wrapper for their own duration."""
    global _original
    with _lock:
        if _original is None:
            return
        if hasattr(autograd_graph._engine_run_backward, "__acshim_unwind__"):
            autograd_graph._engine_run_backward = _original
        if hasattr(torch.autograd._engine_run_backward, "__acshim_unwind__"):
            torch.autograd._engine_run_backward = _original
        _original = None

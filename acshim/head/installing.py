"""Putting the chunked head on a model and taking it off: the head found (``find_head``), its forward
replaced per instance (``HeadForward``), TRL's fused head run at the chunk size, and the record of
what was installed where, held weakly and undone by ``remove`` / ``remove_all`` (``acshim.uninstall``)."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .chunks import DEFAULT_CHUNK_BYTES, MODES, HeadConfig, rows_per_chunk
from .loss import as_logits
from .projection import HeadProjection


class HeadForward:
    """The instance ``forward`` of an output projection (``nn.Linear``) run by this module."""

    def __init__(self, module: nn.Linear, mode: str, chunk_bytes: int, exact: bool) -> None:
        self.module, self.mode, self.chunk_bytes, self.exact = module, mode, chunk_bytes, exact

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        module = self.module
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(hidden, module.weight, module.bias)
        config = HeadConfig(self.mode, self.chunk_bytes, self.exact)
        if self.mode == "loss" or not (hidden.requires_grad or module.weight.requires_grad):
            config.mode = "loss"
            return as_logits(F.linear(hidden, module.weight, module.bias), config)
        logits = HeadProjection.apply(hidden, module.weight, module.bias, config)
        config.node, config.shape = logits.grad_fn, tuple(logits.shape)
        return as_logits(logits, config)

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeadForward, (self.module, self.mode, self.chunk_bytes, self.exact))


def find_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection: ``get_output_embeddings()`` of a Hugging Face model (PEFT's
    wrappers included) when it is a plain ``nn.Linear``; None otherwise."""
    for module in model.modules():
        getter = getattr(type(module), "get_output_embeddings", None)
        if getter is None:
            continue
        try:
            head = module.get_output_embeddings()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if type(head) is nn.Linear:
            return head
    return None


@dataclass
class _Installed:
    head: nn.Linear | None
    mode: str
    trl_chunk: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class HeadInstalls:
    """What ``install`` put on which model, keyed by the model's identity and held weakly: an entry
    leaves with its model, so a new model that happens to get a collected one's ``id`` is never
    taken for installed. Also TRL's own ``TOKEN_CHUNK_SIZE``, kept to be put back."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[weakref.ref[nn.Module], _Installed]] = {}
        self.trl_default: int | None = None

    def get(self, model: nn.Module) -> _Installed | None:
        entry = self._records.get(id(model))
        return entry[1] if entry is not None and entry[0]() is model else None

    def put(self, model: nn.Module, record: _Installed) -> None:
        key = id(model)
        self._records[key] = (weakref.ref(model, functools.partial(self._forget, key)), record)

    def pop(self, model: nn.Module) -> _Installed | None:
        record = self.get(model)
        if record is not None:
            del self._records[id(model)]
        return record

    def models(self) -> list[nn.Module]:
        """The models with an install, still alive."""
        return [model for model in (ref() for ref, _ in self._records.values()) if model is not None]

    def records(self) -> list[_Installed]:
        """The records of the models still alive."""
        return [record for ref, record in self._records.values() if ref() is not None]

    def __len__(self) -> int:
        return len(self.records())

    def _forget(self, key: int, ref: weakref.ref[nn.Module]) -> None:
        entry = self._records.get(key)
        if entry is not None and entry[0] is ref:
            del self._records[key]


INSTALLS = HeadInstalls()


_TRL_KERNEL = "trl.kernels.chunked_logprob"


def install(model: nn.Module, mode: str = "head", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            exact: bool = True) -> bool:
    """Run ``model``'s head and cross-entropy in chunks (``mode``: ``loss`` or ``head``, see the module
    docstring); in ``head`` mode TRL's fused head (when imported) runs its token tiles at the chunk
    size too. Returns False when the model has neither a head this module can run nor TRL's fused
    head. ``remove(model)`` undoes it."""
    if mode not in MODES:
        raise ValueError(f"acshim.head.install: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"acshim.head.install: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    remove(model)
    head = find_head(model)
    trl = sys.modules.get(_TRL_KERNEL) if mode == "head" and _fused_by_trl(model) else None
    if head is None and trl is None:
        return False
    record = _Installed(head, mode)
    if head is not None:
        head.forward = HeadForward(head, mode, chunk_bytes, exact)
    if trl is not None:
        if INSTALLS.trl_default is None:
            INSTALLS.trl_default = trl.TOKEN_CHUNK_SIZE
        vocab = head.weight.shape[0] if head is not None else _trl_vocab(model)
        record.trl_chunk = rows_per_chunk(vocab, 4, chunk_bytes)
        trl.TOKEN_CHUNK_SIZE = record.trl_chunk
    INSTALLS.put(model, record)
    return True


def remove(model: nn.Module) -> None:
    """Undo ``install`` (nothing to do when it was not installed)."""
    record = INSTALLS.pop(model)
    if record is None:
        return
    if record.head is not None and isinstance(record.head.__dict__.get("forward"), HeadForward):
        del record.head.forward
    if record.trl_chunk is not None and not any(r.trl_chunk for r in INSTALLS.records()) \
            and INSTALLS.trl_default is not None:
        trl = sys.modules.get(_TRL_KERNEL)
        if trl is not None:
            trl.TOKEN_CHUNK_SIZE = INSTALLS.trl_default


def remove_all() -> None:
    """Undo ``install`` on every model that still has it, TRL's chunk size put back too: what
    ``acshim.uninstall()`` calls, so no head stays replaced once acshim is uninstalled."""
    for model in INSTALLS.models():
        remove(model)


def installed_mode(model: nn.Module) -> str | None:
    """The mode ``install`` put on ``model``, None when none."""
    record = INSTALLS.get(model)
    return record.mode if record is not None else None


def available(model: nn.Module) -> bool:
    """Whether ``install`` has something to run on ``model`` (a plain linear head, or TRL's fused head)."""
    return find_head(model) is not None or (_TRL_KERNEL in sys.modules and _fused_by_trl(model))


@contextlib.contextmanager
def chunked(model: nn.Module, mode: str = "head", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            exact: bool = True) -> Iterator[bool]:
    """``install`` for the duration of a ``with`` block (yields whether anything was installed)."""
    done = install(model, mode, chunk_bytes=chunk_bytes, exact=exact)
    try:
        yield done
    finally:
        if done:
            remove(model)


def _fused_by_trl(model: nn.Module) -> bool:
    """TRL's ``add_fused_lm_head`` replaced a forward of ``model`` (or of a module inside it)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":  # functools.wraps renamed the function
            return True
    return False


def _trl_vocab(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 32000) or 32000)

"""``smp.save`` / ``smp.load`` and the v1.10+ checkpoint helpers, for one process.

``save``/``load`` write and read one file with ``torch.save``/``torch.load`` (upstream writes a
partial file per rank; with one rank that is the whole object). ``save_checkpoint`` /
``resume_from_checkpoint`` use SMP's own directory layout and are not provided: they raise
``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any

import torch


def save(obj: Any, f: Any, partial: bool = True, pickle_module: Any = None, pickle_protocol: int = 2,
         v3: bool = False) -> None:
    kwargs: dict[str, Any] = {"pickle_protocol": pickle_protocol}
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    torch.save(obj, f, **kwargs)


def load(f: Any, map_location: Any = None, pickle_module: Any = None, partial: bool = True,
         **pickle_load_args: Any) -> Any:
    kwargs: dict[str, Any] = dict(pickle_load_args)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    kwargs.setdefault("weights_only", False)
    return torch.load(f, map_location=map_location, **kwargs)


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    raise NotImplementedError(
        "smp.save_checkpoint writes SMP's sharded checkpoint layout, which acshim does not provide; save "
        "model.state_dict() and optimizer.state_dict() with smp.save or torch.save instead")


def resume_from_checkpoint(path: str, tag: str | None = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Any = None) -> None:
    raise NotImplementedError(
        "smp.resume_from_checkpoint reads SMP's sharded checkpoint layout, which acshim does not provide; load "
        "a state dict with smp.load or torch.load and call model.load_state_dict / optimizer.load_state_dict")

__all__ = ["load", "resume_from_checkpoint", "save", "save_checkpoint"]

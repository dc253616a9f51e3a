"""Find a model's repeated blocks (the transformer layers) without per-architecture tables."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def class_names_argument(function: str, class_names: Iterable[str] | str | None) -> tuple[str, ...] | None:
    """``class_names`` as a tuple: a bare string is one name (not its letters); anything but strings
    raises ``TypeError``."""
    if class_names is None:
        return None
    names = (class_names,) if isinstance(class_names, str) else class_names
    try:
        names = tuple(names)
    except TypeError:
        names = (names,)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"{function}: class_names must be class names as strings, e.g. ('LlamaDecoderLayer',), "
                        f"got {class_names!r}")
    return names


def find_blocks(model: nn.Module, class_names: Iterable[str] | str | None = None) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified name, module)`` for the model's repeated blocks, outermost first.

    With ``class_names`` (e.g. a Hugging Face model's ``_no_split_modules``), every module of one of
    those classes that is not inside another match. Otherwise the children of the largest
    ``nn.ModuleList`` / ``nn.Sequential`` whose children all share one class (at least two of them);
    ties go to the container met first. Returns ``[]`` when nothing repeats.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks needs an nn.Module, got {type(model).__name__}")
    class_names = class_names_argument("find_blocks", class_names)
    if class_names is not None:
        wanted = set(class_names)
        found: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if module is model or type(module).__name__ not in wanted:
                continue
            if any(name.startswith(outer + ".") for outer, _ in found):
                continue
            found.append((name, module))
        return found

    # Homogeneous containers grouped by block class; the class with the most blocks wins, and all
    # of its containers are returned (T5 keeps encoder and decoder blocks in two lists).
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        kinds = {type(child) for _, child in children}
        if len(kinds) != 1:
            continue
        prefix = f"{name}." if name else ""
        found = by_class.setdefault(kinds.pop(), [])
        if any(prefix.startswith(outer + ".") for outer, _ in found):
            continue
        found.extend((prefix + child_name, child) for child_name, child in children)
    if not by_class:
        return []
    return max(by_class.values(), key=len)

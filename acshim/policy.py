"""Which parts of a model become checkpointed regions.

A policy looks at a model and returns targets: single modules (each one region) or an
``nn.Sequential`` split into groups of consecutive children (each group one region, SageMaker's
``each`` / ``contiguous`` / ``group_N`` strategies). Policies are small classes with one
``select(model)`` method, in the manner of torchtitan's activation-checkpoint policies.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .blocks import class_names_argument, find_blocks


@dataclass(frozen=True)
class ModuleTarget:
    name: str
    module: nn.Module


@dataclass(frozen=True)
class SequentialTarget:
    name: str
    module: nn.Sequential
    groups: tuple[tuple[int, ...], ...]
    pack_args_as_tuple: bool = False


Target = ModuleTarget | SequentialTarget


class Policy:
    """Base class: ``select(model)`` returns the targets, outermost first."""

    def select(self, model: nn.Module) -> list[Target]:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"

    def _outermost(self, model: nn.Module, keep: Callable[[str, nn.Module], bool]) -> list[Target]:
        targets: list[Target] = []
        for name, module in model.named_modules():
            if any(name.startswith(t.name + ".") or t.name == "" for t in targets):
                continue
            if keep(name, module):
                targets.append(ModuleTarget(name, module))
        return targets


class Blocks(Policy):
    """The model's repeated blocks (``find_blocks``): the default policy."""

    def __init__(self, class_names: Sequence[str] | str | None = None) -> None:
        self.class_names = class_names_argument("Blocks", class_names)

    def select(self, model: nn.Module) -> list[Target]:
        return [ModuleTarget(n, m) for n, m in find_blocks(model, self.class_names)]

    def __repr__(self) -> str:
        return f"Blocks({self.class_names!r})" if self.class_names else "Blocks()"


class ByClass(Policy):
    """Every module that is an instance of one of ``classes`` (classes, or class names as strings)."""

    def __init__(self, *classes: type[nn.Module] | str) -> None:
        if not classes:
            raise ValueError("ByClass needs at least one class, e.g. ByClass(nn.TransformerEncoderLayer)")
        for cls in classes:
            if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
                raise TypeError(f"ByClass takes nn.Module subclasses or class names, got {cls!r}")
        self.classes = classes

    def _matches(self, module: nn.Module) -> bool:
        return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in self.classes)

    def select(self, model: nn.Module) -> list[Target]:
        return self._outermost(model, lambda name, module: module is not model and self._matches(module))


class ByName(Policy):
    """Modules whose qualified name matches one of ``patterns`` (shell globs such as ``"layers.*"``;
    a pattern starting with ``re:`` is a full-match regular expression)."""

    def __init__(self, *patterns: str) -> None:
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise TypeError("ByName takes one or more name patterns as strings, e.g. ByName('h.*')")
        self.patterns = patterns
        self._regexes = [re.compile(p[3:] if p.startswith("re:") else fnmatch.translate(p)) for p in patterns]

    def select(self, model: nn.Module) -> list[Target]:
        return self._outermost(model, lambda name, module: bool(name) and any(r.fullmatch(name) for r in self._regexes))


class Predicate(Policy):
    """Modules for which ``fn(module)`` or ``fn(name, module)`` returns True (root excluded)."""

    def __init__(self, fn: Callable[..., bool]) -> None:
        if not callable(fn):
            raise TypeError(f"Predicate takes a callable, got {type(fn).__name__}")
        self.fn = fn
        try:
            arity = len([p for p in inspect.signature(fn).parameters.values()
                         if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        except (TypeError, ValueError):
            arity = 1
        self._takes_name = arity >= 2

    def select(self, model: nn.Module) -> list[Target]:
        def keep(name: str, module: nn.Module) -> bool:
            if module is model:
                return False
            return bool(self.fn(name, module) if self._takes_name else self.fn(module))

        return self._outermost(model, keep)


class EveryNth(Policy):
    """Every ``n``-th target of ``of`` (default: the repeated blocks), starting at index ``start``.

    ``EveryNth(2)`` takes blocks 0, 2, 4… (Hugging Face ``every_n_layers``); ``EveryNth(2, start=1)``
    takes 1, 3, 5… (Modalities' ``ac_freq``).
    """

    def __init__(self, n: int, of: Policy | None = None, start: int = 0) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"EveryNth needs a whole number n >= 1, got {n!r}")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"EveryNth start must be a whole number >= 0, got {start!r}")
        try:
            chosen = as_policy(of)
        except TypeError:
            raise TypeError(f"EveryNth of= must be a Policy (or a shorthand apply_checkpointing accepts), got "
                            f"{of!r}; e.g. EveryNth(2, of=ByClass(MyBlock))") from None
        self.n, self.of, self.start = n, chosen, start

    def select(self, model: nn.Module) -> list[Target]:
        chosen = self.of.select(model)
        return [t for i, t in enumerate(chosen) if i >= self.start and (i - self.start) % self.n == 0]


_GROUP = re.compile(r"group_(\d+)")
STRATEGIES = ("each", "contiguous", "group_N")


def strategy_groups(strategy: str, length: int) -> list[tuple[int, ...]]:
    """Split ``length`` children by an SMP strategy (one partition): ``each`` (one child per
    region), ``contiguous`` (all children in one region), ``group_N`` (N per region, shorter last)."""
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string such as 'each', 'contiguous' or 'group_2', got {strategy!r}")
    if strategy == "each":
        size = 1
    elif strategy == "contiguous":
        size = max(length, 1)
    else:
        match = _GROUP.fullmatch(strategy)
        if not match or int(match.group(1)) < 1:
            raise ValueError(
                f"Unknown activation checkpointing strategy {strategy!r}: use 'each', 'contiguous' "
                "or 'group_<N>' with N >= 1 (e.g. 'group_2')")
        size = int(match.group(1))
    return [tuple(range(i, min(i + size, length))) for i in range(0, length, size)]


class SequentialStrategy(Policy):
    """Group the children of an ``nn.Sequential`` (the model itself or the submodule ``target``)
    into regions by SMP strategy: ``"each"``, ``"contiguous"`` or ``"group_N"``."""

    def __init__(self, strategy: str = "each", target: str = "", pack_args_as_tuple: bool = False) -> None:
        strategy_groups(strategy, 1)  # validates
        if not isinstance(target, str):
            raise TypeError(f"SequentialStrategy target must be a submodule name ('' for the model), got {target!r}")
        if not isinstance(pack_args_as_tuple, bool):
            raise TypeError(f"SequentialStrategy pack_args_as_tuple must be True or False, got {pack_args_as_tuple!r}")
        self.strategy, self.target, self.pack_args_as_tuple = strategy, target, pack_args_as_tuple

    def select(self, model: nn.Module) -> list[Target]:
        module = model.get_submodule(self.target) if self.target else model
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                f"strategy {self.strategy!r} groups the children of an nn.Sequential, but "
                f"{self.target or 'the model'} is a {type(module).__name__}")
        groups = tuple(strategy_groups(self.strategy, len(module)))
        return [SequentialTarget(self.target, module, groups, self.pack_args_as_tuple)]


PolicyLike = Policy | type | str | Callable[..., bool] | Sequence[Any] | None


def as_policy(policy: PolicyLike) -> Policy:
    """Coerce the shorthands ``apply_checkpointing`` accepts into a ``Policy``:
    None -> ``Blocks()``; a module class or tuple of classes -> ``ByClass``; a string -> ``ByName``;
    a callable -> ``Predicate``."""
    if policy is None:
        return Blocks()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type):
        return ByClass(policy)
    if isinstance(policy, str):
        return ByName(policy)
    if isinstance(policy, (tuple, list)) and policy and all(isinstance(p, (type, str)) for p in policy):
        return ByClass(*policy)
    if callable(policy):
        return Predicate(policy)
    raise TypeError(
        f"policy must be a Policy, a module class, a name pattern, a predicate or None, got {type(policy).__name__}")

"""Regions never let a forward's writes into a cache argument reach the recompute (issue 8, item 3).

A toy cache named like Hugging Face's (``transformers.cache_utils.Cache``, matched by name, so
transformers is not needed here) appends keys as ``DynamicCache.update`` does; a recompute that
sees it appends again and attention reads every key twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import acshim
from acshim import region_state

MODES = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


class Cache:
    """Stands in for ``transformers.cache_utils.Cache`` (same module and class name)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.writes = 0

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.writes += 1
        self.keys.append(key)
        return torch.cat(self.keys)


Cache.__module__ = "transformers.cache_utils"


class DynamicCache(Cache):
    pass


class Attention(nn.Module):
    """Self-attention over the cached keys; records the ``use_cache`` each call saw."""

    _can_checkpoint_with_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen_use_cache: list[bool] = []

    def forward(self, x: torch.Tensor, cache: Cache | None = None, use_cache: bool = False) -> torch.Tensor:
        self.seen_use_cache.append(use_cache)
        keys = self.proj(x)
        if cache is not None:
            keys = cache.update(keys)
        return torch.softmax(x @ keys.t(), dim=-1) @ keys


@pytest.fixture(autouse=True)
def _fresh_warning() -> Iterator[None]:
    region_state.warn_use_cache_once.reset()
    yield
    region_state.warn_use_cache_once.reset()


def _grads(module: nn.Module, x: torch.Tensor, call) -> tuple[torch.Tensor, ...]:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    call(x).sum().backward()
    return (x.grad, *(p.grad for p in module.parameters()))


def _expected(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _grads(module, x, lambda t: module(t))


CALLS = {
    "positional": lambda m, x, c, o: acshim.run_region(m, (x, c, True), {}, o),
    "keyword": lambda m, x, c, o: acshim.run_region(m, (x,), {"cache": c, "use_cache": True}, o),
    "nested": lambda m, x, c, o: acshim.run_region(lambda pair, use_cache: m(*pair, use_cache=use_cache),
                                                   ((x, c),), {"use_cache": True}, o),
    "dict": lambda m, x, c, o: acshim.run_region(lambda d: m(d["x"], d["cache"], use_cache=d["use_cache"]),
                                                 ({"x": x, "cache": c, "use_cache": True},), {}, o),
}


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("form", list(CALLS))
def test_region_drops_cache_and_gives_gradients_of_the_cache_off_run(reentrant: bool, form: str) -> None:
    torch.manual_seed(0)
    module, x = Attention(), torch.randn(5, 8)
    expected = _expected(module, x)
    cache = DynamicCache()
    options = acshim.RegionOptions(reentrant=reentrant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(module, x, lambda t: CALLS[form](module, t, cache, options))
        got_again = _grads(module, x, lambda t: CALLS[form](module, t, cache, options))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(expected, got_again, strict=True))
    assert cache.writes == 0 and cache.keys == []  # the caller's cache comes back empty, as with HF
    if form != "dict":  # a dict's use_cache is the callee's business; the cache is still dropped
        assert module.seen_use_cache[1:] == [False] * (len(module.seen_use_cache) - 1)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert messages.count(region_state.USE_CACHE_WARNING) == 1


@pytest.mark.parametrize("reentrant", MODES)
def test_cache_readers_keep_their_cache(reentrant: bool) -> None:
    """``_can_checkpoint_with_cache = True`` (HF's flag for layers that only read the cache)."""

    class Reader(nn.Module):
        _can_checkpoint_with_cache = True

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
            keys = torch.cat([*cache.keys, self.proj(x)])
            return torch.softmax(x @ keys.t(), dim=-1) @ keys

    torch.manual_seed(0)
    module, x, cache = Reader(), torch.randn(5, 8), DynamicCache()
    cache.keys.append(torch.randn(3, 8))
    expected = _grads(module, x, lambda t: module(t, cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _grads(module, x, lambda t: acshim.run_region(module, (t, cache), {}, acshim.RegionOptions(reentrant=reentrant)))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_arguments_without_a_cache_pass_through_as_the_same_objects() -> None:
    args, kwargs = (torch.ones(1), (torch.ones(1), 3), None), {"mask": torch.ones(1), "use_cache": True}
    assert region_state.region_inputs(torch.add, args, kwargs) == (args, kwargs)
    assert region_state.region_inputs(torch.add, args, kwargs)[0] is args
    assert region_state.region_inputs(torch.add, args, kwargs)[1] is kwargs


def test_plain_calls_keep_the_cache() -> None:
    """With grad off (evaluation, generation) a region is a plain call and the cache is filled."""
    module, cache = Attention(), DynamicCache()
    with torch.no_grad():
        acshim.run_region(module, (torch.randn(5, 8), cache, True), {}, acshim.RegionOptions(reentrant=True))
    assert cache.writes == 1 and module.seen_use_cache == [True]

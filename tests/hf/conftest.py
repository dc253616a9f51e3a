"""Fixtures that put process-wide Hugging Face patches in place and always take them out."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")

import acshim.hf as hf
from acshim.hf.caching import warn_use_cache_once


@pytest.fixture(autouse=True)
def _quiet_and_clean() -> Iterator[None]:
    warn_use_cache_once.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield
    hf.unpatch_transformers()
    hf.uninstall()
    warn_use_cache_once.reset()


@pytest.fixture
def installed() -> Iterator[None]:
    hf.install()
    yield
    hf.uninstall()


@pytest.fixture
def autopatched() -> Callable[..., Any]:
    """Build a model under ``patch_transformers(**options)`` and unpatch right after."""

    def build(factory: Callable[[], Any], **options: Any) -> Any:
        hf.patch_transformers(**options)
        try:
            return factory()
        finally:
            hf.unpatch_transformers()

    return build

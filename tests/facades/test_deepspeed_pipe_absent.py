"""acshim's DeepSpeed facade (what ``import deepspeed`` gives under ``acshim run`` where DeepSpeed is not
installed) covers activation checkpointing only: ``deepspeed.pipe`` (``PipelineModule``,
``LayerSpec``, ``TiedLayerSpec``) is not there, and importing it fails with the module's name. With
the real DeepSpeed installed, its PipelineModule runs under acshim (tests/distributed/test_deepspeed_pipeline.py)."""

from __future__ import annotations

import importlib

import pytest


def test_the_facade_has_no_pipeline_module_and_says_which_module_is_missing() -> None:
    facade = importlib.import_module("acshim.facades.deepspeed")
    assert not hasattr(facade, "pipe") and not hasattr(facade, "PipelineModule")
    with pytest.raises(ModuleNotFoundError, match=r"acshim\.facades\.deepspeed\.pipe"):
        importlib.import_module("acshim.facades.deepspeed.pipe")

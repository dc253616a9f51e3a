"""The ``torch.sagemaker.init`` configuration (SMP v2 docs "SMP v2 core features configuration").

Sources, lowest to highest precedence: the defaults below, the ``config`` argument of
``tsm.init`` (a dict or the path of a JSON file), then the JSON object in the environment variable
``SM_HP_MP_PARAMETERS`` (what SageMaker sets from the estimator's ``parameters``; the docs say
estimator values override the script's). Values are validated with errors naming the key; a key
the docs do not list is ignored with a warning (the script may target a newer SMP release).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from acshim.facades.smdistributed.modelparallel.torch.config import (
    environment_config as _smp_environment_config,
)

DEFAULTS: dict[str, Any] = {
    "hybrid_shard_degree": 0,
    "sm_activation_offloading": True,
    "activation_loading_horizon": 2,
    "fsdp_cache_flush_warnings": True,
    "allow_empty_shards": False,
    "tensor_parallel_degree": 1,
    "context_parallel_degree": 1,
    "expert_parallel_degree": 1,
    "random_seed": None,
}
"""Every documented key and its default."""

_BOOLS = ("sm_activation_offloading", "fsdp_cache_flush_warnings", "allow_empty_shards")
_DEGREES = ("tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_config_argument(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``config`` argument of ``tsm.init`` as a dict: a mapping, a JSON file path, or None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"torch.sagemaker.init: config file {str(path)!r} does not exist; pass a dict or the "
                             "path of an existing JSON file")
        try:
            parsed = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"torch.sagemaker.init: cannot parse {str(path)!r} as JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"torch.sagemaker.init: {str(path)!r} must hold a JSON object, got {type(parsed).__name__}")
        return parsed
    raise TypeError(f"torch.sagemaker.init takes a dict, a JSON file path or None, got {type(config).__name__}")


def environment_config() -> dict[str, Any]:
    """The launcher's ``SM_HP_MP_PARAMETERS`` (shared with SMP v1); bad JSON raises ValueError."""
    return _smp_environment_config(ValueError)


def validate(values: dict[str, Any], world_size: int) -> None:
    """Raise ``ValueError`` naming the first bad key (types, ranges, degrees against ``world_size``)."""
    for key in _BOOLS:
        if not isinstance(values[key], bool):
            raise ValueError(f"{key} must be True or False, got {values[key]!r}")
    horizon = values["activation_loading_horizon"]
    if not _is_int(horizon) or horizon < 1:
        raise ValueError(f"activation_loading_horizon must be a positive int, got {horizon!r}")
    shard = values["hybrid_shard_degree"]
    if not _is_int(shard) or not 0 <= shard <= world_size:
        raise ValueError(f"hybrid_shard_degree must be an int between 0 and the world size ({world_size}), got {shard!r}")
    for key in _DEGREES:
        degree = values[key]
        if not _is_int(degree) or not 1 <= degree <= world_size:
            raise ValueError(f"{key} must be an int between 1 and the world size ({world_size}), got {degree!r}")
    if values["context_parallel_degree"] > 1 and values["context_parallel_degree"] > max(shard, 1):
        raise ValueError("context_parallel_degree must not exceed hybrid_shard_degree")
    seed = values["random_seed"]
    if seed is not None and not _is_int(seed):
        raise ValueError(f"random_seed must be an int, got {seed!r}")


def merge(config: str | os.PathLike[str] | Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Defaults < ``config`` < ``SM_HP_MP_PARAMETERS``, validated."""
    merged = dict(DEFAULTS)
    for source in (load_config_argument(config), environment_config()):
        for key, value in source.items():
            if key not in DEFAULTS:
                warnings.warn(f"torch.sagemaker.init: unknown config key {key!r} ignored; known keys: "
                              f"{', '.join(DEFAULTS)}", stacklevel=3)
                continue
            merged[key] = value
    validate(merged, world_size)
    return merged

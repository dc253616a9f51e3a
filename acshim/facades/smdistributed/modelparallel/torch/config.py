"""The ``smp.init`` configuration: known keys, defaults, validation and where values come from.

Mirrors the library's ``ModelParallelConfig`` (smdistributed.modelparallel.backend.config) as far as a
script can observe it:

- sources, lowest to highest precedence: the defaults, the dict passed to ``smp.init``, then the
  JSON object in the environment variable ``SM_HP_MP_PARAMETERS`` (what the SageMaker launcher sets
  from the estimator's ``parameters``; upstream lets it override the script's dict);
- ``partitions`` is an alias of ``pipeline_parallel_degree`` (conflicting values are an error);
- an unknown key is an error ("Unrecognized config parameter ...");
- each value is checked for type, allowed options and bounds with upstream's messages, plus the
  SageMaker SDK's cross-key checks (``ddp`` with ``horovod``, ``default_partition`` ...).

Keys acshim does not model (placement, DDP, fp16, sharding, ...) are accepted, validated and kept
in ``SMPConfig.values`` for scripts that read them; they change nothing. Deliberate difference:
``activation_loading_horizon`` follows the library (``>= 0``), not the docs' "larger than 0".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .exceptions import SMPInvalidArgumentError

ENV_VAR = "SM_HP_MP_PARAMETERS"
ALIASES = {"partitions": "pipeline_parallel_degree"}


@dataclass(frozen=True)
class Key:
    """One config key: accepted types, default, and optional options / inclusive bounds."""

    types: tuple[type, ...]
    default: Any
    options: tuple[Any, ...] | None = None
    lower: float | None = None
    upper: float | None = None


_INT, _BOOL, _STR, _FLOAT = (int,), (bool,), (str,), (float, int)
_PLACEMENTS = ("cluster", "spread", "PDT", "PTD", "DPT", "DTP", "TPD", "TDP")

SCHEMA: dict[str, Key] = {
    "pipeline_parallel_degree": Key(_INT, 1, lower=1),
    "tensor_parallel_degree": Key(_INT, 1, lower=1),
    "microbatches": Key(_INT, 1, lower=1),
    "pipeline": Key(_STR, "interleaved", options=("simple", "interleaved", "_only_forward")),
    "horovod": Key(_BOOL, False),
    "ddp": Key(_BOOL, False),
    "ddp_port": Key((int, type(None)), None, lower=0),
    "ddp_dist_backend": Key(_STR, "nccl", options=("nccl",)),
    "sharded_data_parallel_degree": Key(_INT, 1, lower=1),
    "sdp_reduce_bucket_size": Key(_FLOAT, int(5e8)),
    "sdp_param_persistence_threshold": Key(_FLOAT, int(1e6)),
    "sdp_max_live_parameters": Key(_FLOAT, int(1e9)),
    "sdp_hierarchical_allgather": Key(_BOOL, True),
    "sdp_gradient_clipping": Key(_FLOAT, 1.0),
    "contiguous": Key(_BOOL, True),
    "placement_strategy": Key(_STR, "cluster", options=_PLACEMENTS),
    "optimize": Key(_STR, "speed", options=("speed", "memory")),
    "auto_partition": Key(_BOOL, True),
    "default_partition": Key((int, type(None)), None, lower=0),
    "prescaled_batch": Key(_BOOL, False),
    "memory_weight": Key(_FLOAT, 0.8, lower=0.0, upper=1.0),
    "active_microbatches": Key(_INT, None, lower=1),
    "fast_mode": Key(_BOOL, False),
    "static_mode": Key(_BOOL, False),
    "fp16": Key(_BOOL, False),
    "bf16": Key(_BOOL, False),
    "fp16_params": Key(_BOOL, False),
    "tensor_parallel_seed": Key(_INT, 0, lower=0),
    "offload_activations": Key(_BOOL, False),
    "shard_optimizer_state": Key(_BOOL, False),
    "delayed_parameter_initialization": Key(_BOOL, False),
    "skip_tracing": Key(_BOOL, False),
    "activation_loading_horizon": Key(_INT, 4, lower=0),
    "checkpoint_attentions": Key(_BOOL, False),
    "load_partition": Key(_BOOL, False),
    "partition_file": Key((str, type(None)), None),
    "deterministic_server": Key(_BOOL, False),
}
"""Every key the library accepts (its config schema), with its type, default and limits."""


@dataclass
class SMPConfig:
    """The validated configuration. Attribute access reads a key: ``cfg.microbatches``."""

    values: dict[str, Any] = field(default_factory=dict)
    provided: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"SMP config has no parameter {name!r}")

    @property
    def partitions(self) -> int:
        return self.values["pipeline_parallel_degree"]


def environment_config(error: type[Exception] = SMPInvalidArgumentError) -> dict[str, Any]:
    """The JSON object in ``SM_HP_MP_PARAMETERS`` (empty when unset), where the SageMaker launcher
    puts the estimator's parameters for SMP v1 and v2 alike; ``error`` is raised for bad JSON."""
    raw = os.environ.get(ENV_VAR, "")
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as problem:
        raise error(f"{ENV_VAR} must hold a JSON object of SMP parameters: {problem}") from None
    if not isinstance(parsed, dict):
        raise error(f"{ENV_VAR} must hold a JSON object of SMP parameters, got {type(parsed).__name__}")
    return parsed


def _check_value(name: str, value: Any, key: Key) -> None:
    # bool is a subclass of int: compare exact types, as upstream does (type(value) in types).
    if type(value) not in key.types:
        names = [t.__name__ for t in key.types]
        raise SMPInvalidArgumentError(
            f"Config parameter {name} type needs to be one of {names}. Found: {type(value).__name__}.")
    if key.options is not None and value not in key.options:
        raise SMPInvalidArgumentError(f"Config parameter {name} must be one of {list(key.options)}. Found: {value}.")
    if value is None:
        return
    if key.lower is not None and value < key.lower:
        raise SMPInvalidArgumentError(f"Config parameter {name} ({value}) cannot be less than {key.lower}.")
    if key.upper is not None and value > key.upper:
        raise SMPInvalidArgumentError(f"Config parameter {name} ({value}) cannot be larger than {key.upper}.")


def _resolve_aliases(config: dict[str, Any]) -> None:
    for alias, original in ALIASES.items():
        if alias in config:
            if original in config and config[alias] != config[original]:
                raise SMPInvalidArgumentError(
                    f"Conflicting values {config[original]} and {config[alias]} are provided for config "
                    f"parameter {original} and its alias {alias}.")
            config[original] = config.pop(alias)


def _cross_checks(values: dict[str, Any], provided: set[str]) -> None:
    if values["horovod"] and values["ddp"]:
        raise SMPInvalidArgumentError("'ddp' and 'horovod' cannot be simultaneously enabled.")
    if values["tensor_parallel_degree"] > 1 and not values["ddp"]:
        raise SMPInvalidArgumentError(
            f"Setting config parameter tensor_parallel_degree to non-default value "
            f"{values['tensor_parallel_degree']} requires ddp to be set to True. Found: False")
    if "ddp_port" in provided and not values["ddp"]:
        raise SMPInvalidArgumentError("`ddp_port` needs `ddp` to be set as well")
    if values["auto_partition"] is False and values["default_partition"] is None:
        raise SMPInvalidArgumentError("default_partition must be supplied if auto_partition is set to False!")
    if values["default_partition"] is not None and values["default_partition"] >= values["pipeline_parallel_degree"]:
        raise SMPInvalidArgumentError("default_partition must be less than the number of partitions!")
    if values["active_microbatches"] is None:
        values["active_microbatches"] = min(values["pipeline_parallel_degree"] + 2, values["microbatches"])
    elif values["active_microbatches"] > values["microbatches"]:
        raise SMPInvalidArgumentError(
            f"Config parameter active_microbatches ({values['active_microbatches']}) cannot be larger than "
            f"microbatches ({values['microbatches']}).")


def parse_config(config: Mapping[str, Any] | None = None, *, use_environment: bool = True) -> SMPConfig:
    """Merge defaults < ``config`` < ``SM_HP_MP_PARAMETERS`` and validate the result."""
    if config is not None and not isinstance(config, Mapping):
        raise SMPInvalidArgumentError(
            f"smp.init takes a dict of SMP parameters (or nothing), got {type(config).__name__}")
    merged = dict(config or {})
    if use_environment:
        merged.update(environment_config())
    _resolve_aliases(merged)
    for name in merged:
        if name not in SCHEMA:
            raise SMPInvalidArgumentError(f"Unrecognized config parameter {name}.")
    values: dict[str, Any] = {}
    for name, key in SCHEMA.items():
        if name in merged:
            _check_value(name, merged[name], key)
            values[name] = merged[name]
        else:
            values[name] = key.default
    _cross_checks(values, set(merged))
    return SMPConfig(values, frozenset(merged))

__all__ = []

"""The ``"activation_checkpointing"`` block of a DeepSpeed config.

Mirrors deepspeed/runtime/activation_checkpointing/config.py (key names and defaults) and the way
``DeepSpeedConfig`` accepts a config: a dict, a path to a JSON file or a base64-encoded JSON string.
Deliberate difference: only the activation-checkpointing block is read. Upstream builds the whole
``DeepSpeedConfig`` and so also demands a batch size (``train_batch_size`` or
``train_micro_batch_size_per_gpu``); acshim runs no DeepSpeed engine and does not.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import os
from typing import Any

__all__ = ["DeepSpeedActivationCheckpointingConfig"]

ACT_CHKPT = "activation_checkpointing"
ACT_CHKPT_PARTITION_ACTIVATIONS = "partition_activations"
ACT_CHKPT_NUMBER_CHECKPOINTS = "number_checkpoints"
ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION = "contiguous_memory_optimization"
ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY = "synchronize_checkpoint_boundary"
ACT_CHKPT_PROFILE = "profile"
ACT_CHKPT_CPU_CHECKPOINTING = "cpu_checkpointing"

ACT_CHKPT_DEFAULT: dict[str, Any] = {
    ACT_CHKPT_PARTITION_ACTIVATIONS: False,
    ACT_CHKPT_NUMBER_CHECKPOINTS: None,
    ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION: False,
    ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY: False,
    ACT_CHKPT_PROFILE: False,
    ACT_CHKPT_CPU_CHECKPOINTING: False,
}


class DeepSpeedActivationCheckpointingConfig:
    """The six activation-checkpointing settings read from a full DeepSpeed config dict.

    A missing block gives all defaults; unknown keys inside the block are ignored (as upstream).
    """

    def __init__(self, param_dict: dict[str, Any]) -> None:
        block = param_dict.get(ACT_CHKPT, ACT_CHKPT_DEFAULT)
        if not isinstance(block, dict):
            raise TypeError(f'the "{ACT_CHKPT}" section of a DeepSpeed config must be a JSON object, '
                            f"got {type(block).__name__}")
        self.partition_activations = block.get(ACT_CHKPT_PARTITION_ACTIVATIONS, False)
        self.contiguous_memory_optimization = block.get(ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION, False)
        self.cpu_checkpointing = block.get(ACT_CHKPT_CPU_CHECKPOINTING, False)
        self.number_checkpoints = block.get(ACT_CHKPT_NUMBER_CHECKPOINTS, None)
        self.profile = block.get(ACT_CHKPT_PROFILE, False)
        self.synchronize_checkpoint_boundary = block.get(ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY, False)

    def repr(self) -> dict[str, Any]:
        """The settings as a dict (upstream ``DeepSpeedConfigObject.repr``)."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(key for key, _ in pairs)
    duplicates = [key for key, count in counts.items() if count > 1]
    if duplicates:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicates}")
    return dict(pairs)


def load_param_dict(config: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict, a JSON file path or base64 JSON, as a dict.

    Objects that already carry a parsed config (a ``DeepSpeedConfig``: ``_param_dict``) are accepted.
    """
    if isinstance(config, dict):
        return config
    param_dict = getattr(config, "_param_dict", None)
    if isinstance(param_dict, dict):
        return param_dict
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config) as handle:
            try:
                loaded = json.load(handle, object_pairs_hook=_reject_duplicate_keys)
            except json.JSONDecodeError as error:
                raise ValueError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: {error}; fix the file "
                                 "or pass the config as a dict") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeed config {os.fspath(config)!r} must hold a JSON object "
                             f"({{\"activation_checkpointing\": {{...}}}}), got a {type(loaded).__name__}")
        return loaded
    try:
        decoded = base64.urlsafe_b64decode(config).decode("utf-8")
        return json.loads(decoded, object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, AttributeError, TypeError, ValueError, binascii.Error) as error:
        if isinstance(error, ValueError) and str(error).startswith("Duplicate keys"):
            raise
        raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary or a valid "
                         f"base64. Received: {config}") from None


def activation_checkpointing_config(config: Any) -> DeepSpeedActivationCheckpointingConfig:
    """The activation-checkpointing settings of ``config`` (see ``load_param_dict``)."""
    return DeepSpeedActivationCheckpointingConfig(load_param_dict(config))

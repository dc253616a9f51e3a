"""``modalities.config.config.ActivationCheckpointedModelConfig`` and its parameter classes.

Upstream these are pydantic models; here they are small classes with the same constructor keywords
and the same validation (``ac_freq`` a strict int >= 1, ``save_ops_keys`` a list of strings), so the
facade needs no pydantic. Unknown keywords are ignored, as pydantic's default does.
"""

from __future__ import annotations

from typing import Any


class _Params:
    _fields: tuple[str, ...] = ()

    def __init__(self, **values: Any) -> None:
        missing = [name for name in self._fields if name not in values]
        if missing:
            raise ValueError(f"{type(self).__name__}: field(s) {', '.join(missing)} required")
        for name in self._fields:
            setattr(self, name, self._validate(name, values[name]))

    def _validate(self, name: str, value: Any) -> Any:
        return value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, f) == getattr(other, f) for f in self._fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)!r}' for f in self._fields)})"


class ActivationCheckpointedModelConfig:
    """What an activation-checkpointed model is built from: ``ac_variant``, ``layers_fqn``, ``model``
    and ``ac_fun_params`` (one of the three parameter classes below)."""

    class FullACParams(_Params):
        """Full activation checkpointing takes no parameters."""

    class SelectiveLayerACParams(_Params):
        """``ac_freq``: checkpoint every ``ac_freq``-th layer (the ``ac_freq``-th, 2x``ac_freq``-th, ...)."""

        _fields = ("ac_freq",)
        ac_freq: int

        def _validate(self, name: str, value: Any) -> Any:
            if type(value) is not int or value < 1:
                raise ValueError(f"SelectiveLayerACParams: ac_freq must be an integer >= 1, got {value!r}")
            return value

    class SelectiveOpACParams(_Params):
        """``save_ops_keys``: keys of ``ActivationCheckpointing.SAVE_DICT`` whose outputs are kept."""

        _fields = ("save_ops_keys",)
        save_ops_keys: list[str]

        def _validate(self, name: str, value: Any) -> Any:
            if not isinstance(value, (list, tuple)) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"SelectiveOpACParams: save_ops_keys must be a list of strings, got {value!r}")
            return list(value)

    def __init__(self, ac_variant: Any, layers_fqn: str, model: Any, ac_fun_params: Any) -> None:
        from ..training.activation_checkpointing.activation_checkpointing_variants import (
            ActivationCheckpointingVariants,
        )

        self.ac_variant = ActivationCheckpointingVariants(getattr(ac_variant, "value", ac_variant))
        self.layers_fqn = layers_fqn
        self.model = model
        self.ac_fun_params = ac_fun_params


__all__ = ["ActivationCheckpointedModelConfig"]

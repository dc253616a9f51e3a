"""SMP v1 error classes, with the library's names and messages (smdistributed.modelparallel.torch.exceptions).

Upstream's validation errors derive from ``ValueError``; so do these. Where upstream raised a bare
``AssertionError`` for a wrong argument type, the class here is both a ``TypeError`` and an
``AssertionError`` so code catching either keeps working.
"""

from __future__ import annotations


class SMPValidationError(ValueError):
    """Base of every user-facing SMP validation error (upstream: a ``ValueError``)."""


class SMPInvalidArgumentError(SMPValidationError):
    """A bad ``smp.init`` config value or a bad argument."""


class CheckpointingConfigError(SMPValidationError):
    """Activation checkpointing asked for something it cannot do (e.g. a strategy on a non-Sequential)."""


class NotAModuleError(TypeError, AssertionError):
    """``checkpoint`` / ``checkpoint_sequential`` got something other than the module type they need."""


class TensorSplitError(RuntimeError):
    """``smp.step`` could not split its inputs into microbatches."""


class InvalidStepOutputError(SMPValidationError):
    def __init__(self, outputs_type: type) -> None:
        super().__init__(f"StepOutput only accepts list or tuple, but get {outputs_type}")


class NotInitializedError(SMPValidationError):
    def __str__(self) -> str:
        return "smp is not initialized!"


class BwdExecutionNotInStepFnError(SMPValidationError):
    def __str__(self) -> str:
        return "smp.DistributedModel's backward can only be run inside smp.step annotated function"


class DistributedModelNotWrappedError(SMPValidationError):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg

    def __str__(self) -> str:
        return f"The model needs to be wrapped with smp.DistributedModel before {self.msg}"


class ModelNotPartitionedError(SMPValidationError):
    def __str__(self) -> str:
        return ("Model has not been partitioned yet. You can call this method after first step when using "
                "autopartitioning.")


class MultipleDistributedModelError(SMPValidationError):
    def __str__(self) -> str:
        return "Using DistributedModel wrapper more than once in a process is not supported yet"


class SMPUnsupportedError(RuntimeError):
    """Something the single-process facade cannot do truthfully (e.g. point-to-point messages)."""

__all__ = [
    "SMPValidationError",
    "SMPInvalidArgumentError",
    "CheckpointingConfigError",
    "NotAModuleError",
    "TensorSplitError",
    "InvalidStepOutputError",
    "NotInitializedError",
    "BwdExecutionNotInStepFnError",
    "DistributedModelNotWrappedError",
    "ModelNotPartitionedError",
    "MultipleDistributedModelError",
    "SMPUnsupportedError",
]

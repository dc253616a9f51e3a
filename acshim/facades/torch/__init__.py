"""Facades for PyTorch-side APIs: ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``
(PyTorch) and ``torch.sagemaker`` (SageMaker model parallelism v2)."""

"""The sanitizer's control (docs/gpu.md): under ``TORCH_CUDA_SANITIZER=1``, does a non-reentrant
checkpoint with dropout fail in plain torch too, with no acshim code? On torch 2.11 (an H100) all three
rows failed with "dropout ... returned NULL without setting an exception".

    TORCH_CUDA_SANITIZER=1 PYTHONPATH=. python benchmarks/gpu_sanitizer_control.py
"""

import sys

import torch

if not torch.cuda.is_available():
    print("no GPU: skipped")
    sys.exit(0)

import acshim
from acshim.storage import boundary_offload
from acshim.testing import seeded, tiny_sequential


def run(name, fn):
    try:
        fn()
        torch.cuda.synchronize()
        print(name, "ok", flush=True)
    except Exception as error:  # a finding to print, not a crash
        print(name, "FAILED", type(error).__name__, str(error)[:300], flush=True)

x = torch.randn(64, 256, device="cuda")
def plain_torch():
    m = seeded(lambda: tiny_sequential(2, 256)).cuda()
    out = x
    for layer in m:
        out = torch.utils.checkpoint.checkpoint(layer, out, use_reentrant=False)
    out.sum().backward()
def acshim_recompute():
    m = seeded(lambda: tiny_sequential(2, 256)).cuda()
    acshim.apply_checkpointing(m, reentrant=False)
    m(x).sum().backward()
def acshim_host_offload():
    m = seeded(lambda: tiny_sequential(2, 256)).cuda()
    acshim.apply_checkpointing(m, saved_tensors_scope=boundary_offload("host", 1, min_bytes=0), reentrant=False)
    m(x).sum().backward()
for name, fn in (("plain-torch-checkpoint-dropout", plain_torch), ("acshim-recompute", acshim_recompute),
                 ("acshim-host-offload", acshim_host_offload)):
    run(name, fn)

"""Which of acshim's ways of running HF GPT-2 gives gradients bitwise equal to no checkpointing on a
GPU, parameter by parameter (issue 26: ``gpu_planner.py``'s plan rows differed from its ``none`` row on
an H200). Each configuration starts from the same weights, batch and seed; deterministic kernels.
Prints one line per configuration: how many parameters differ, the largest difference, and the
differing parameters nearest the loss (where a difference starts, backward runs from the loss).

    python benchmarks/gpu_exactness.py [--layers 12 --width 768 --batch 4 --seq 512]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_planner import batch_of, build


def grads(args: argparse.Namespace, configure: Callable[[torch.nn.Module], None]) -> dict[str, torch.Tensor]:
    model = build(args)
    batch = batch_of(args)
    configure(model)
    model(**batch).loss.backward()  # a warm-up step (the planner plans in it)
    model.zero_grad(set_to_none=False)
    torch.manual_seed(1)
    model(**batch).loss.backward()
    out = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    import acshim
    import acshim.head

    parser = argparse.ArgumentParser()
    for name, default in (("layers", 12), ("width", 768), ("batch", 4), ("seq", 512)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)

    def torch_checkpoint(model: torch.nn.Module) -> None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def acshim_blocks(model: torch.nn.Module) -> None:
        acshim.apply_checkpointing(model)

    def planned(fraction: float) -> Callable[[torch.nn.Module], None]:
        def configure(model: torch.nn.Module) -> None:
            plan = acshim.plan(model, batch_of(args), fraction, loss_fn=lambda out: out.loss)
            print(f"  plan {fraction}: {plan.describe()}", flush=True)
            plan.apply(model)
        return configure

    configurations: dict[str, Callable[[torch.nn.Module], None]] = {
        "none again": lambda model: None,
        "torch checkpoint (HF gradient_checkpointing_enable)": torch_checkpoint,
        "acshim recompute, every block": acshim_blocks,
        "acshim chunked loss only": lambda model: acshim.head.install(model, "loss"),
        "acshim chunked head only": lambda model: acshim.head.install(model, "head"),
        "acshim.plan 0.5": planned(0.5),
    }
    reference = grads(args, lambda model: None)
    names = list(reference)
    for label, configure in configurations.items():
        try:
            got = grads(args, configure)
        except Exception as error:  # a finding, not a crash
            print(f"{label}: raised {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        differ = [n for n in names if not torch.equal(got[n], reference[n])]
        largest = max((float((got[n] - reference[n]).abs().max()) for n in differ), default=0.0)
        print(f"{label}: {len(differ)} of {len(names)} differ, largest {largest:.3g}; nearest the loss: "
              f"{differ[::-1][:4]}", flush=True)


if __name__ == "__main__":
    main()

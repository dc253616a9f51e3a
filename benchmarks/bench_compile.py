"""Memory under torch.compile: a compiled GPT-2-shaped model (``acshim.testing.GPT``, 4 layers,
width 256, seq 128, batch 4, dropout on) without checkpointing, with torch's non-reentrant
checkpoint per block, and with ``acshim.apply_checkpointing`` (non-reentrant and reentrant).

Two measures per configuration: the bytes of distinct storages the compiled graph saves for
backward (an outer ``saved_tensors_hooks`` sees AOTAutograd's ``save_for_backward``; parameters and
inputs excluded; what ``tests/engine/test_compile.py`` asserts on), and held/peak RSS of one
compiled step in a fresh process (``memory_probe.py``).

    python benchmarks/bench_compile.py [--backend aot_eager|inductor]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import acshim
from acshim.testing import GPT

CONFIGS = ("none", "torch", "acshim", "acshim_reentrant")
LAYERS, WIDTH, SEQ, BATCH = 4, 256, 128, 4


def build(config: str) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, width=WIDTH, heads=4, seq=SEQ, vocab=512)
    if config == "torch":
        for block in model.h:  # partials: the probe's child cannot import this file for Dynamo's globals
            block.forward = functools.partial(torch_checkpoint.checkpoint, block.forward, use_reentrant=False)
    elif config != "none":
        acshim.apply_checkpointing(model, reentrant=config == "acshim_reentrant")
    return model, torch.randint(0, 512, (BATCH, SEQ))


def compiled_step(argv: list[str]) -> tuple[torch.nn.Module, Any]:
    """Builder for memory_probe: argv = [config, backend]."""
    config, backend = argv
    torch.set_num_threads(1)
    model, ids = build(config)
    step = torch.compile(model, backend=backend)
    return model, functools.partial(step, ids)


def saved_bytes(config: str, backend: str) -> int:
    model, ids = build(config)
    step = torch.compile(model, backend=backend)
    step(ids).backward()
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()} | {ids.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(ids)
    loss.backward()
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory_probe

    print(f"backend {args.backend}: GPT {LAYERS}x{WIDTH}, seq {SEQ}, batch {BATCH}")
    print(f"{'config':18s} {'saved MB':>9s} {'held RSS MB':>12s} {'peak RSS MB':>12s}")
    for config in CONFIGS:
        torch._dynamo.reset()
        saved = saved_bytes(config, args.backend)
        rss = memory_probe.probe(__file__, "compiled_step", [config, args.backend])
        print(f"{config:18s} {saved / 2**20:9.2f} {rss['held_bytes'] / 2**20:12.2f} {rss['peak_bytes'] / 2**20:12.2f}",
              flush=True)


if __name__ == "__main__":
    main()

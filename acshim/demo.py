"""``acshim demo``: the main job in one command. Trains one step of a built-in GPT-2-shaped model
with and without checkpointing, prints the memory held for backward and confirms that gradients
are bitwise identical."""

from __future__ import annotations

import argparse

import torch

from .apply import apply_checkpointing
from .measure import measure_memory
from .testing import GPT, seeded, train_step


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acshim demo", description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reentrant", action="store_true", help="use reentrant regions")
    args = parser.parse_args(argv)

    def build() -> GPT:
        return seeded(lambda: GPT(layers=args.layers, width=args.width, heads=4, seq=args.seq, vocab=1024))

    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"GPT-2-shaped model: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, "
          f"dropout on, torch {torch.__version__}")

    plain = measure_memory(build(), ids, loss_fn=_loss)
    model = build()
    regions = apply_checkpointing(model, reentrant=args.reentrant)
    checkpointed = measure_memory(model, ids, loss_fn=_loss)

    mib = 2**20
    print(f"checkpointed regions: {len(regions)} ({regions[0]} ... {regions[-1]})")
    print(f"held for backward without checkpointing: {plain.held_bytes / mib:8.2f} MiB")
    print(f"held for backward with acshim:           {checkpointed.held_bytes / mib:8.2f} MiB "
          f"({checkpointed.held_bytes / plain.held_bytes:.2f}x)")

    expected = train_step(build(), ids, loss_fn=_loss)
    actual = train_step(model, ids, loss_fn=_loss)
    grads = [k for k in expected if k.startswith("grad:")]
    identical = all(torch.equal(expected[k], actual[k]) for k in expected) and set(expected) == set(actual)
    print(f"gradients of {len(grads)} parameters bitwise identical to the run without checkpointing: "
          f"{'yes' if identical else 'NO'}")
    return 0 if identical and checkpointed.held_bytes < plain.held_bytes else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A Hugging Face training loop on FSDP2, run by tests/distributed as
``torchrun ... -m acshim run --budget B sharded_hf_budget.py [--rows R,R,...]``: a GPT-2 from a small
config (random weights, a large vocabulary, so the logits dominate), ``fully_shard`` per block and
on the root, ``gradient_checkpointing_enable()`` (non-reentrant) and ``labels`` passed for the loss:
the same steps (dropout on, ``R`` sequences of ``SEQUENCE`` tokens each) without checkpointing and
then with it. Every rank prints ``RESULT {json}`` as ``sharded_budget.py`` does, with the plan's
part outside the blocks (``outside``), its choices offered (``offered``) and how it was
measured (``method``)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from sharded_budget import (  # the script's folder: sys.path[0]
    _kib,
    _step_start,
    fsdp2_weights,
    report,
    unplanned,
)
from torch import nn

SEQUENCE = 128
VOCAB = 8192
BLOCKS = 4


def gpt2(checkpointed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=BLOCKS, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQUENCE)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(checkpointed: bool, rows: list[int], peaks: list[int]) -> list[torch.Tensor]:
    """The steps; the full weights after them."""
    model, optimizer = gpt2(checkpointed)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, VOCAB, (count, SEQUENCE), generator=generator) for count in rows]
    torch.manual_seed(1000 + dist.get_rank())
    for ids in batches:
        start = _step_start()
        model(input_ids=ids, labels=ids).loss.backward()
        peaks.append(_kib("VmHWM") - start)
        optimizer.step()
        optimizer.zero_grad()
    return fsdp2_weights(model)


def main() -> None:
    global VOCAB
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="8,8,8,8,8,8,8,8")
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    VOCAB = args.vocab
    dist.init_process_group("gloo")
    rows = [int(count) for count in args.rows.split(",")]
    import acshim

    sessions = list(acshim.region.ROUTERS)
    none: list[int] = []
    reference = unplanned(lambda: train(False, rows, none))
    peaks: list[int] = []
    weights = train(True, rows, peaks)
    result = {"rank": dist.get_rank(), "equal": all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True)),
              "finite": all(bool(w.isfinite().all()) for w in weights), "peaks": peaks, "none": none}
    if sessions and sessions[0].plan is not None:
        session = sessions[0]
        plan = session.plan
        result.update(choices=plan.choices, outside=plan.outside, budget=plan.budget,
                      offered=plan.profile.outside_choices(), method=plan.profile.method, predicted=plan.peak,
                      measured=session._lockstep.peaks if session._lockstep else None)
    report(result)


if __name__ == "__main__":
    main()

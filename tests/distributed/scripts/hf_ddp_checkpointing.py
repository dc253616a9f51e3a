"""A Hugging Face data-parallel training script written only against upstream APIs (transformers,
torch DDP): GPT-2 and Llama built from small configs (4 layers, dropout on), wrapped in
``DistributedDataParallel(find_unused_parameters=True)``, two steps each rank on its own data.
Run by tests/distributed under torchrun and ``acshim run`` (with and without ``--hf``).

Each ``--case`` trains fresh models and saves every rank's gradients after the allreduce to
``OUT/<case>-rank<R>.pt`` ({arch: {name: grad}}):
  none        no checkpointing (the reference)
  reentrant   ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``
  default     ``gradient_checkpointing_enable()``
  as-built    the models as built (``acshim run --hf`` checkpoints them itself)

usage: hf_ddp_checkpointing.py --out DIR --case CASE [--case CASE ...]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

VOCAB = 64


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":  # dropout 0.1 on embeddings, attention and residuals by default
        config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=32, attention_dropout=0.1)
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def train(arch: str, case: str, rank: int) -> dict[str, torch.Tensor]:
    model = build(arch)
    if case == "reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif case == "default":
        model.gradient_checkpointing_enable()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16))
        ddp(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", choices=("none", "reentrant", "default", "as-built"), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in args.case:
        grads = {arch: train(arch, case, rank) for arch in ("gpt2", "llama")}
        torch.save(grads, os.path.join(args.out, f"{case}-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""acshim auto-patching vs transformers' own gradient_checkpointing_enable, side by side.

For GPT-2 and Llama shapes (8 layers, width 512, sequence 256, batch 2, dropout on): memory held
for backward when forward ends (acshim.measure.measure_memory, counted per storage) and training
step time. Following docs/measuring.md: one process, one torch thread, configurations
interleaved with their order rotated each round, median of per-round ratios reported.

    python benchmarks/bench_hf.py [--rounds 5] [--layers 8] [--width 512] [--seq 256] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers

import acshim.hf as hf
from acshim.measure import measure_memory
from acshim.testing import train_step


def gpt2(layers: int, width: int) -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=8, n_positions=1024, vocab_size=8192, bos_token_id=0, eos_token_id=1,
        resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1))


def llama(layers: int, width: int) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=8192, max_position_embeddings=1024, attention_dropout=0.1))


def build(factory, kind: str, layers: int, width: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "acshim":
        hf.patch_transformers()
        try:
            model = factory(layers, width)
        finally:
            hf.unpatch_transformers()
    else:
        model = factory(layers, width)
        if kind == "hf":
            model.gradient_checkpointing_enable()  # transformers' own (torch checkpoint, non-reentrant in 5.x)
    model.train()
    return model


def timed_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    start = time.perf_counter()
    model(**inputs).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    print(f"shape: {args.layers} layers x {args.width}, batch {args.batch} x {args.seq}, dropout 0.1, "
          f"1 thread, {args.rounds} rounds, transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'model':6} {'held none MB':>12} {'held HF MB':>10} {'held acshim MB':>14} {'held a/HF':>9} "
          f"{'step HF s':>9} {'step acshim s':>13} {'time a/HF':>9} grads")
    for name, factory in (("gpt2", gpt2), ("llama", llama)):
        models = {kind: build(factory, kind, args.layers, args.width) for kind in ("none", "hf", "acshim")}
        held = {kind: measure_memory(model, inputs).held_bytes for kind, model in models.items()}
        same = all(torch.equal(a, b) for a, b in zip(train_step(models["hf"], inputs).values(),
                                                      train_step(models["acshim"], inputs).values()))
        times: dict[str, list[float]] = {"hf": [], "acshim": []}
        ratios = []
        order = ["hf", "acshim"]
        for _ in ("warm", "up"):
            for kind in order:
                timed_step(models[kind], inputs)
        for round_index in range(args.rounds):
            this_round = order[round_index % 2:] + order[:round_index % 2]
            for kind in this_round:
                times[kind].append(timed_step(models[kind], inputs))
            ratios.append(times["acshim"][-1] / times["hf"][-1])
        mb = 2**20
        print(f"{name:6} {held['none'] / mb:12.1f} {held['hf'] / mb:10.1f} {held['acshim'] / mb:14.1f} "
              f"{held['acshim'] / held['hf']:9.3f} {statistics.median(times['hf']):9.3f} "
              f"{statistics.median(times['acshim']):13.3f} {statistics.median(ratios):9.3f} "
              f"{'bitwise equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()

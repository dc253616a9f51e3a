"""Step time of HF GPT-2 (4 x 256, batch 4 x 128, one torch thread, dropout on) under
``gradient_checkpointing_enable`` on acshim's engine, reentrant or not: the engine's own overhead.
Run it for two code trees, interleaved, to compare them (each prints its median step)::

    for round in 1 2 3; do
        PYTHONPATH=old python benchmarks/bench_engine_overhead.py reentrant
        PYTHONPATH=new python benchmarks/bench_engine_overhead.py reentrant
    done
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("reentrant", "non-reentrant"))
    parser.add_argument("--steps", type=int, default=12, help="timed steps (the first two are dropped)")
    mode = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import transformers

    import acshim.hf

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    acshim.hf.install()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode.mode == "reentrant"})
    ids = torch.randint(0, 1000, (4, 128))
    times = []
    for _ in range(mode.steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    kept = sorted(times[2:])
    print(json.dumps({"mode": mode.mode, "median_s": kept[len(kept) // 2]}))


if __name__ == "__main__":
    main()

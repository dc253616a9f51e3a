"""A plain Hugging Face training loop, as users write it (issue 26's "12-line loop"): a 6x128 Llama
(vocabulary 512) with ``gradient_checkpointing_enable()``, AdamW, 4 steps of batch 8 x 121 tokens.
Saves the weights to ``sys.argv[1]`` and prints ``RSS {"peak": bytes, "budget": bytes or null}``: the
resident high-water mark above what the process held when the first step started (the heap trimmed
and the mark reset there), so planning counts."""

import ctypes
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_mark() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


LAYERS, WIDTH, VOCAB, BATCH, SEQ = (int(v) for v in os.environ.get("PLAIN_LOOP_SHAPE", "6,128,512,8,121").split(","))
"""Layers, width, vocabulary, batch and sequence length: issue 26's loop by default; another shape
for docs/planner.md's figures (``PLAIN_LOOP_SHAPE=4,256,32000,2,256``)."""

torch.manual_seed(0)
config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH * 43 // 16,  # 344 at 128
                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.1)
model = LlamaForCausalLM(config)
model.gradient_checkpointing_enable()
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = [torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(4)]

FROM_STEP = int(os.environ.get("PLAIN_LOOP_FROM_STEP", "1"))
"""The step (1-based) whose start is the baseline: 1 counts planning, 2 the planned steps only."""
for step, ids in enumerate(batches, 1):
    if step == FROM_STEP:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        baseline = resident()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
peak = high_water_mark() - baseline

torch.save(model.state_dict(), sys.argv[1])
import acshim.region  # noqa: E402  (after the run: present only under acshim run)

routers = acshim.region.ROUTERS
print("RSS " + json.dumps({"peak": peak, "budget": routers[0].plan.budget if routers else None}), flush=True)

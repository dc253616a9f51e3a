"""Two Hugging Face GPT-2 models trained together (issue 26: "a two-model accumulation script is
refused at --budget 0.75"): ``gradient_checkpointing_enable()`` on both, one AdamW over both, two
micro-batches of gradient accumulation per step, dropout on. The first model's forward is the one a
plan is made in; the second's forward and backward run after it, as the script's own part of the
step. Prints ``RESULT {json}``: a digest of every weight after the steps, and each step's ``VmHWM``
above what the process held before the first step (never reset: the whole run so far, as a user
measures it), with the budget in bytes where a plan was made."""

import ctypes
import hashlib
import json
import sys

import torch
import transformers

import acshim.region

WIDTH, SEQ, ROWS, STEPS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def gpt2(layers: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=512, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def status(field: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))


torch.manual_seed(0)
first, second = gpt2(6), gpt2(4)
optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-3)
generator = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 512, (ROWS, SEQ), generator=generator) for _ in range(2 * STEPS)]
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")
start = status("VmRSS")
peaks = []
for step in range(STEPS):
    for micro in range(2):
        ids = batches[2 * step + micro]
        loss = first(input_ids=ids, labels=ids).loss + 0.5 * second(input_ids=ids, labels=ids).loss
        (loss / 2).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peaks.append(status("VmHWM") - start)
digest = hashlib.sha256()
for parameter in [*first.parameters(), *second.parameters()]:
    digest.update(parameter.detach().numpy().tobytes())
routers = acshim.region.ROUTERS
plan = routers[0].plan if routers else None
print("RESULT " + json.dumps({"digest": digest.hexdigest(), "peaks": peaks,
                              "budget": plan.budget if plan is not None else None}), flush=True)

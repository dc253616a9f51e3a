"""A user's process (no ``MALLOC_*`` variable): HF Llama trained a few steps without checkpointing,
then ``acshim.plan(model, batch, budget)`` (a fraction, or bytes), the plan applied and trained on, and a copy of the
model trained on as long without checkpointing (whether the weights are then equal). Prints ``PLANNED``
with the plan's budget and each later step's ``VmHWM`` above what the process held before the call
(planning's one-time imports, made by the call, included), or ``REFUSED`` and the error."""

import copy
import ctypes
import json
import sys

import torch
import transformers

import acshim
from acshim import host_allocator

layers, width, seq = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
budget = float(sys.argv[4]) if "." in sys.argv[4] else int(sys.argv[4])  # a fraction, or bytes
torch.manual_seed(0)
config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3,
                                  num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                                  max_position_embeddings=seq)
model = transformers.LlamaForCausalLM(config).train()
ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": ids, "labels": ids}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(net: torch.nn.Module | None = None, opt: torch.optim.Optimizer | None = None) -> None:
    net, opt = net or model, opt or optimizer
    net(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def status(field: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))


for _ in range(3):  # steps of no checkpointing before planning, as a user's process has run
    step()
# the same model and optimizer, trained on without checkpointing afterwards: the reference weights
reference = copy.deepcopy(model)
reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages given back, as the planner's baseline has them
held = status("VmRSS")  # the budget is what the process may hold above this, planning's own imports included
try:
    plan = acshim.plan(model, batch, budget)
except ValueError as error:
    print("REFUSED", str(error).splitlines()[0])
    sys.exit(0)
plan.apply(model)
peaks = []
for _ in range(3):
    with open("/proc/self/clear_refs", "w") as clear:  # VmHWM from here: this step's own peak
        clear.write("5")
    step()
    peaks.append(status("VmHWM") - held)
for _ in range(3):
    step(reference, reference_optimizer)
equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))
print("PLANNED", json.dumps({"budget": plan.budget, "peaks": peaks, "installed": host_allocator.installed(),
                             "equal": equal,
                             "predicted": plan.peak + plan.overhead, "measured": plan.measured_process_peak,
                             "notes": plan.notes}))

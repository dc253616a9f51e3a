"""SageMaker model parallelism v1: checkpoint a Hugging Face GPT-2's blocks with
``smp.set_activation_checkpointing`` (dev guide, example 3; a tiny random model, nothing downloaded).

Run with ``acshim run examples/smp_v1_hf_gpt2.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import smdistributed.modelparallel.torch as smp
import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()

smp.init({"partitions": 1, "microbatches": 2, "offload_activations": True, "activation_loading_horizon": 2})
config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                 resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
torch.manual_seed(0)
model = smp.DistributedModel(transformers.GPT2LMHeadModel(config))
if not args.no_checkpointing:
    for child in model.get_module().transformer.h.children():
        smp.set_activation_checkpointing(child)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    model.backward(loss)
    return loss


generator = torch.Generator().manual_seed(2)
input_ids = torch.randint(0, 128, (4, 16), generator=generator)
model.train()
optimizer.zero_grad()
torch.manual_seed(1)
loss = train_step(model, input_ids).reduce_mean()
print(f"loss {loss.item():.6f}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
optimizer.step()
print(f"GRADS {digest.hexdigest()}")

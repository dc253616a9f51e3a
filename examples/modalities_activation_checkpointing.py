"""Modalities: ``ActivationCheckpointing.apply_activation_checkpointing_`` on three copies of a small
GPT-2-style model (blocks in a ModuleDict at ``transformer.h``), one per variant: full, selective
layer (every 2nd block) and selective op (matmul outputs kept).

Run with ``acshim run examples/modalities_activation_checkpointing.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from modalities.config.config import ActivationCheckpointedModelConfig
from modalities.training.activation_checkpointing.activation_checkpointing import ActivationCheckpointing
from modalities.training.activation_checkpointing.activation_checkpointing_variants import (
    ActivationCheckpointingVariants,
)

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class GPT2Block(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(),
                                 nn.Linear(4 * width, width, bias=False), nn.Dropout(0.1))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + F.dropout(self.proj(y), 0.1, self.training)
        return x + self.mlp(self.ln_2(x))


class GPT2LLM(nn.Module):
    def __init__(self, layers=4, vocab=64, width=32):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, width),
            "h": nn.ModuleDict({str(i): GPT2Block(width) for i in range(layers)}),
            "lm_head": nn.Linear(width, vocab, bias=False),
        })

    def forward(self, inputs):
        x = self.transformer.wte(inputs["input_ids"])
        for block in self.transformer.h.values():
            x = block(x)
        return {"logits": self.transformer.lm_head(x)}


VARIANTS = [
    (ActivationCheckpointingVariants.FULL_ACTIVATION_CHECKPOINTING, ActivationCheckpointedModelConfig.FullACParams()),
    (ActivationCheckpointingVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING,
     ActivationCheckpointedModelConfig.SelectiveLayerACParams(ac_freq=2)),
    (ActivationCheckpointingVariants.SELECTIVE_OP_ACTIVATION_CHECKPOINTING,
     ActivationCheckpointedModelConfig.SelectiveOpACParams(save_ops_keys=["ops.aten.mm.default"])),
]

digest = hashlib.sha256()
ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(2))
for variant, params in VARIANTS:
    torch.manual_seed(0)
    model = GPT2LLM()
    if not args.no_checkpointing:
        ActivationCheckpointing.apply_activation_checkpointing_(variant, "transformer.h", model, params)
    torch.manual_seed(1)
    logits = model({"input_ids": ids[:, :-1]})["logits"]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss.backward()
    print(f"{variant.value}: loss {loss.item():.6f}")
    for _, param in model.named_parameters():
        if param.grad is not None:
            digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
print(f"GRADS {digest.hexdigest()}")

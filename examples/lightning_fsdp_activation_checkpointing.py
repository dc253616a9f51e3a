"""Lightning 2.6: ``FSDPStrategy(activation_checkpointing_policy={Block})``.

Lightning applies the policy with torch's ``apply_activation_checkpointing`` right after wrapping
the model in FSDP (``FSDPStrategy.setup_module``); under ``acshim run`` those wrappers are acshim's
and ``--report`` names the regions ``lightning FSDPStrategy``. FSDP itself needs a GPU (Lightning
refuses it on CPU, and torch's FSDP needs an accelerator), so on a CPU-only machine this script
runs the strategy's own activation-checkpointing step (``_setup_activation_checkpointing`` with the
strategy's parsed policy) on the unsharded model; on a GPU the same strategy object goes to
``L.Fabric(strategy=...)``. Needs ``pip install lightning==2.6.6``.

Run with ``acshim run examples/lightning_fsdp_activation_checkpointing.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import torch
import torch.nn as nn
from lightning.fabric.strategies import FSDPStrategy
from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), *[Block() for _ in range(4)], nn.Linear(32, 1))
if not args.no_checkpointing:
    strategy = FSDPStrategy(activation_checkpointing_policy={Block})
    if torch.cuda.is_available():
        import lightning as L

        fabric = L.Fabric(accelerator="cuda", devices=1, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(model)
    else:
        _setup_activation_checkpointing(model, strategy._activation_checkpointing_kwargs)

x = torch.randn(8, 16)
for _ in range(2):
    model(x).pow(2).mean().backward()

digest = hashlib.sha256()
for name, parameter in sorted(model.named_parameters()):
    digest.update(name.replace("_checkpoint_wrapped_module.", "").encode())
    digest.update(parameter.grad.cpu().numpy().tobytes())
print("GRADS", digest.hexdigest())

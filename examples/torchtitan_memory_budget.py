"""torchtitan: ``MemoryBudgetAC.Config(memory_budget=0.5)`` applied by torchtitan's own config object,
in eager mode.

Written purely against torchtitan's API. Plain torchtitan only sets
``torch._functorch.config.activation_memory_budget``, which nothing reads without ``torch.compile``;
under `acshim run examples/torchtitan_memory_budget.py` the blocks of ``model.layers`` are planned by
acshim within the budget as torch means it (0.0 full recompute's activation memory, 1.0 no
checkpointing's). `--no-checkpointing` runs the same steps without it. Last line: GRADS <sha256 of
all gradients of the last step>.
"""

import hashlib
import sys

import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

    def forward(self, x):
        return x + self.mlp(x)


class Model(nn.Module):
    """torchtitan's layout: the repeated blocks in ``model.layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(6)})
        self.output = nn.Linear(256, 16)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x)


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    if "--no-checkpointing" not in sys.argv:
        MemoryBudgetAC.Config(memory_budget=0.5).build().apply(model)
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1))
    for step in range(2):  # the first step is planned, the second runs the plan
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2 + step)
        loss = model(x).square().mean()
        loss.backward()
    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        digest.update(parameter.grad.detach().contiguous().numpy().tobytes())
    print(f"loss {loss.item():.6f}")
    print(f"GRADS {digest.hexdigest()}")


if __name__ == "__main__":
    main()

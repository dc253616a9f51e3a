"""Helpers for proving checkpointing exact: tiny models with random weights, one training step,
and bitwise comparison of gradients and buffers. Used by acshim's own tests and benchmarks; handy
for users checking their own models."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .measure import default_loss


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """Build ``factory()`` after ``torch.manual_seed(seed)``: the same weights every time."""
    torch.manual_seed(seed)
    return factory()


def train_step(model: nn.Module, inputs: Any, *, seed: int = 1,
               loss_fn: Callable[[Any], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One forward/backward of ``model`` on ``inputs`` (tensor, tuple or kwargs dict) under
    ``torch.manual_seed(seed)`` (so dropout masks repeat). Returns the step's state: every
    parameter's gradient (``grad:<name>``), every buffer (``buffer:<name>``) and ``loss``."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if isinstance(inputs, dict):
        output = model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        output = model(*inputs)
    else:
        output = model(inputs)
    loss = (loss_fn or default_loss)(output)
    loss.backward()
    result = {"loss": loss.detach().clone()}
    for name, param in model.named_parameters():
        if param.grad is not None:
            result[f"grad:{name}"] = param.grad.detach().clone()
    for name, buffer in model.named_buffers():
        result[f"buffer:{name}"] = buffer.detach().clone()
    return result


def assert_bitwise_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Fail unless both step states have the same keys and bitwise-identical tensors."""
    missing = sorted(set(expected) ^ set(actual))
    if missing:
        raise AssertionError(f"step states differ in entries: {missing[:10]}")
    differing = [k for k in expected if not torch.equal(expected[k], actual[k])]
    if differing:
        worst = max(differing, key=lambda k: (expected[k].float() - actual[k].float()).abs().max().item())
        delta = (expected[worst].float() - actual[worst].float()).abs().max().item()
        raise AssertionError(f"{len(differing)} tensors differ, e.g. {differing[:5]}; largest |diff| {delta:g} in {worst}")
    if not any(k.startswith("grad:") for k in expected):
        raise AssertionError("the step produced no parameter gradients")


# --------------------------------------------------------------------------------------------------
# tiny models (random weights, dropout on)


class MLPBlock(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


def open_descriptors_in(directory: str | os.PathLike[str]) -> list[str]:
    """Targets of this process's open file descriptors inside ``directory`` (unlinked files too,
    ``... (deleted)``): what the disk tier still holds there. Linux ``/proc``."""
    prefix = str(directory)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


def tiny_sequential(depth: int = 4, width: int = 64) -> nn.Sequential:
    """An ``nn.Sequential`` of residual MLP blocks with dropout."""
    return nn.Sequential(*[MLPBlock(width) for _ in range(depth)])


class ConvBNNet(nn.Module):
    """A small conv net with BatchNorm and dropout, blocks in ``self.blocks``."""

    def __init__(self, channels: int = 8, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                          nn.Dropout(0.1))
            for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))


def hf_config(arch: str, **overrides: Any) -> Any:
    """A tiny Hugging Face config for ``arch`` in gpt2, llama, mistral, qwen2, bert, t5, vit."""
    import transformers

    common = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    table: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                                bos_token_id=0, eos_token_id=1, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        "llama": lambda: transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                  max_position_embeddings=64, attention_dropout=0.1),
        "mistral": lambda: transformers.MistralConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                      max_position_embeddings=64, attention_dropout=0.1),
        "qwen2": lambda: transformers.Qwen2Config(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                  max_position_embeddings=64, attention_dropout=0.1),
        "bert": lambda: transformers.BertConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                                **common),
        "t5": lambda: transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16,
                                            num_heads=4, vocab_size=128, dropout_rate=0.1,
                                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        "vit": lambda: transformers.ViTConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                              num_attention_heads=4, image_size=32, patch_size=8, **common),
    }
    if arch not in table:
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(table)}")
    config = table[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def hf_model(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny randomly initialised Hugging Face model (LM head / masked LM / seq2seq / image
    classifier) for ``arch``; nothing is downloaded."""
    import transformers

    config = hf_config(arch, **overrides)
    classes = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
               "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
               "bert": transformers.BertForMaskedLM, "t5": transformers.T5ForConditionalGeneration,
               "vit": transformers.ViTForImageClassification}
    torch.manual_seed(seed)
    model = classes[arch](config)
    model.train()
    return model


def hf_inputs(arch: str, batch: int = 2, seq: int = 16, seed: int = 2) -> dict[str, torch.Tensor]:
    """Keyword inputs with labels for ``hf_model(arch)``, so ``output.loss`` is set."""
    generator = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=generator),
                "labels": torch.randint(0, 2, (batch,), generator=generator)}
    ids = torch.randint(0, 128, (batch, seq), generator=generator)
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, 128, (batch, seq // 2), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


class GPTBlock(nn.Module):
    """A GPT-2-shaped pre-norm transformer block (causal self-attention + 4x MLP), dropout on."""

    def __init__(self, width: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.resid_dropout(self.proj(attn.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.resid_dropout(self.out(torch.nn.functional.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """A GPT-2-shaped language model in plain PyTorch (no transformers needed): token and position
    embeddings, ``layers`` blocks in ``self.h``, a final norm and a tied LM head. ``forward(ids)``
    returns the mean next-token cross-entropy."""

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, seq: int = 64, vocab: int = 512,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def write_finetuning_fixture(directory: str, *, vocab: int = 32000, hidden: int = 128, layers: int = 4,
                             rows: int = 16, words: int = 63, seed: int = 0) -> dict[str, str]:
    """A fine-tuning set-up on disk, as a Hugging Face script expects to load it, with nothing
    downloaded: a tiny random-weight ``LlamaForCausalLM`` (``layers`` x ``hidden``, a vocabulary of
    ``vocab``, untied head) with a word-level tokenizer in ``model/``, and ``data/train.jsonl`` /
    ``data/test.jsonl`` of ``rows`` texts of ``words`` random words each (every row the same token
    count). Returns the paths: ``{"model": ..., "data": ...}``."""
    import json
    import os

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir, data_dir = os.path.join(directory, "model"), os.path.join(directory, "data")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    table = {token: index for index, token in enumerate(specials)}
    table.update({f"w{i}": i for i in range(len(specials), vocab)})
    word_level = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>",
                                                     pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(model_dir)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                      max_position_embeddings=max(256, words + 2), pad_token_id=1, bos_token_id=2,
                                      eos_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    for split in ("train", "test"):
        with open(os.path.join(data_dir, f"{split}.jsonl"), "w", encoding="utf-8") as file:
            for _ in range(rows):
                ids = torch.randint(len(specials), vocab, (words,), generator=generator).tolist()
                file.write(json.dumps({"text": " ".join(f"w{i}" for i in ids)}) + "\n")
    return {"model": model_dir, "data": data_dir}

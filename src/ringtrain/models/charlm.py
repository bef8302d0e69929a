"""Character-level language models: the seeds' language model scaled to a CPU.

The vocabulary is the 256 byte values, so any text is input without a vocabulary file.
A batch is ``(inputs, targets)``, both ``(batch, seq_len)`` int64, where ``targets`` is
``inputs`` shifted left by one byte; the loss is the mean cross-entropy of predicting each
next byte.

Two architectures:

- :class:`CharTransformer` (registry names ``charlm`` and ``charlm-transformer``): byte and
  position embeddings, ``n_layers`` pre-norm decoder blocks (causal self-attention, then a
  GELU MLP of width 4·d), a final norm and an output head. Many small parameter tensors
  (12 per block), which is what makes gradient merging matter.
- :class:`CharLSTM` (``charlm-lstm``): byte embedding, a stacked ``nn.LSTM``, output head.
  Few, larger parameter tensors.

Attention is written out (matmul, mask, softmax) rather than through a fused kernel so
that its backward is plainly deterministic on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import ReferenceModel, check_positive, generator

VOCAB = 256


class _Block(nn.Module):
    """One pre-norm decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        scores = scores.masked_fill(mask, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class CharTransformer(ReferenceModel):
    """A small GPT-style byte-level transformer."""

    family = "charlm"

    def __init__(self, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, max_seq_len: int = 256):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads),
                            ("max_seq_len", max_seq_len)):
            check_positive(name, value)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_tokens(tokens)
        t = tokens.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.max_seq_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        # Built per call rather than kept as a buffer: the model has no buffers to broadcast.
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def make_batch(self, batch_size: int, seed: int = 0, seq_len: int = 64):
        if isinstance(seq_len, int) and seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds this model's max_seq_len={self.max_seq_len}")
        return random_text_batch(batch_size, seq_len, seed)

    def dataset_kwargs(self):
        return {"seq_len": min(64, self.max_seq_len)}


class CharLSTM(ReferenceModel):
    """Byte embedding, stacked LSTM, linear head."""

    family = "charlm"

    def __init__(self, embed_dim: int = 64, hidden_size: int = 256, n_layers: int = 2):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("hidden_size", hidden_size), ("n_layers", n_layers)):
            check_positive(name, value)
        self.embed = nn.Embedding(VOCAB, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden_size, num_layers=n_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_tokens(tokens)
        y, _ = self.lstm(self.embed(tokens))
        return self.head(y)

    def make_batch(self, batch_size: int, seed: int = 0, seq_len: int = 64):
        return random_text_batch(batch_size, seq_len, seed)

    def dataset_kwargs(self):
        return {"seq_len": 64}


def check_tokens(tokens: torch.Tensor) -> None:
    """Raise ValueError unless ``tokens`` is a (batch, seq_len) tensor of integer token ids."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        hint = "; for one sequence pass tokens.unsqueeze(0)" if tokens.dim() == 1 else ""
        raise ValueError(f"expected a (batch, seq_len) int64 tensor of token ids (bytes 0..255), got shape "
                         f"{tuple(tokens.shape)} of {tokens.dtype}{hint}")


def random_text_batch(batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random bytes shaped as a language-model batch (inputs, next-byte targets)."""
    check_positive("batch_size", batch_size)
    check_positive("seq_len", seq_len)
    window = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=generator(seed))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()

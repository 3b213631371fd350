"""A small GPT for characters, in the shape of nanoGPT's (pre-norm transformer blocks, learned positions, the
output layer tied to the token embedding), written for this example. ``forward(batch)`` returns the
framework's contract: a dict with the ``loss``."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class SelfAttention(nn.Module):
    """Multi-head causal self-attention (``scaled_dot_product_attention`` with its causal mask)."""

    def __init__(self, width: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.out = nn.Linear(width, width, bias=bias)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.out_dropout(self.out(y.transpose(1, 2).reshape(batch, length, width)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, bias=bias)
        self.attention = SelfAttention(width, heads, dropout, bias)
        self.norm2 = nn.LayerNorm(width, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=bias), nn.GELU(),
                                 nn.Linear(4 * width, width, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    """``layers`` blocks of ``width`` channels and ``heads`` heads over windows of up to ``block_size``
    characters of a ``vocab_size``-character alphabet."""

    def __init__(self, vocab_size: int, block_size: int = 64, layers: int = 4, heads: int = 4, width: int = 128,
                 dropout: float = 0.0, bias: bool = False):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, bias) for _ in range(layers))
        self.norm = nn.LayerNorm(width, bias=bias)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token.weight  # tied: one matrix reads and writes characters
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the projections into the residual
            if name.endswith(("attention.out.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.token(idx) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def forward(self, batch) -> dict:
        inputs, targets = batch
        logits = self.logits(inputs)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` (batch, length) continued by ``new_tokens`` sampled characters."""
        for _ in range(new_tokens):
            logits = self.logits(idx[:, -self.block_size:])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

"""Two models for the topology advisor: ``polyparallel plan --model examples.advisor_models:mlp``.

A model factory takes no argument and returns an ``nn.Module``, or a dict with

- ``"model"``: the ``nn.Module`` (built on the device the caller chose: the advisor builds it on
  ``meta``, a measured run on the process's device);
- ``"inputs"``: ``inputs(batch, seq_len) -> (x, y)``, one batch of inputs and targets;
- ``"loss_fn"``: ``loss_fn(output, y)`` (default: mean squared error);
- ``"options"``: the ``wrap_model`` options, or ``options(topology) -> dict`` (``plan=`` for
  ``tensor > 1``, ``microbatches=`` for pipelines).

A bare ``nn.Sequential`` whose first and last parametrised layers are ``nn.Linear`` needs none of
this: its inputs and targets are random vectors of the first layer's input and the last layer's
output width, and ``tensor > 1`` uses the Megatron default plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["mlp", "transformer", "Block", "Embed", "Head"]


def mlp(width: int = 512, inputs: int = 128, depth: int = 2) -> nn.Sequential:
    """``depth`` Megatron pairs (``inputs -> width -> inputs``) with ReLUs: a bare Sequential."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, inputs)]
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Embed(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, vocab: int, dim: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: token ids ``(batch, seq)``."""
        return self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))


class Attention(nn.Module):
    """Causal self-attention; heads come from the local width (``-1``), so a tensor-parallel
    rank that holds ``heads / tensor`` of them runs it unchanged."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, dim)``."""
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, dim)``."""
        x = x + self.attn(self.norm1(x))
        return x + self.down(self.act(self.up(self.norm2(x))))


class Head(nn.Module):
    """Final norm and the vocabulary projection."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``."""
        return self.out(self.norm(x))


def transformer(vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 4, max_len: int = 64) -> dict[str, Any]:
    """A small GPT as an ``nn.Sequential`` (embedding, blocks, head: a pipeline cuts between
    them) with a Megatron tensor plan (q/k/v and ``up`` column-wise, ``o`` and ``down`` row-wise)."""
    model = nn.Sequential(Embed(vocab, dim, max_len), *(Block(dim, heads) for _ in range(layers)), Head(dim, vocab))

    def inputs(batch: int, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch, (seq_len or 32) + 1))
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    def options(topology: Any) -> dict[str, Any]:
        if topology.size("tensor") == 1:
            return {}
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(1, layers + 1):
            plan.update({f"{i}.attn.q": ColwiseParallel(), f"{i}.attn.k": ColwiseParallel(),
                         f"{i}.attn.v": ColwiseParallel(), f"{i}.attn.o": RowwiseParallel(),
                         f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()})
        return {"plan": plan}

    return {"model": model, "inputs": inputs, "loss_fn": loss_fn, "options": options}

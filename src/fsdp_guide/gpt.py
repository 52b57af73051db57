"""A small GPT decoder, the model the LLM recipe trains (after nanoGPT, kept short to be read).

Token and position embeddings, ``n_layer`` pre-norm transformer blocks (causal
self-attention, then an MLP), a final LayerNorm and an output head tied to the
token embedding. The blocks are the natural FSDP units: each holds about the same
number of parameters and runs once per forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes: the corpus is tokenized at byte level
    block_size: int = 64  # the longest context, in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: expected a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        # Separate projections (not one fused qkv) so that tensor parallelism can shard each
        # by columns: a rank then holds whole heads of q, k and v.
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim  # all of them, or this rank's share under tensor parallelism
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer over bytes.

    Example:

    >>> import torch
    >>> from fsdp_guide.gpt import GPT, GPTConfig
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    >>> model.init_weights()
    >>> tokens, next_tokens = torch.randint(256, (2, 2, 16))
    >>> logits, loss = model(tokens, targets=next_tokens)
    >>> tuple(logits.shape), round(loss.item(), 1)  # about ln(256) = 5.5 before training
    ((2, 16, 256), 5.6)
    >>> model.generate(tokens[:1, :4], max_new_tokens=3).shape
    torch.Size([1, 7])
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one tensor, in the root FSDP unit

    @torch.no_grad()
    def init_weights(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """nanoGPT's initialisation, in a fixed order: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer).

        It draws from the global RNG, so seed it first. Call it on full tensors (before
        sharding, or inside :func:`fsdp_guide.summon_full_params`): on shards every rank
        would draw the same numbers for its own slice. ``params``: initialise only these
        (in the same order), e.g. the ones of the unit gathered now; default: all.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        chosen = None if params is None else {id(p) for p in params}
        for name, param in self.named_parameters():  # a tied parameter is listed once
            if chosen is not None and id(param) not in chosen:
                continue
            if name.endswith("proj.weight"):
                nn.init.normal_(param, 0.0, residual_std)
            elif name.endswith("weight") and param.dim() >= 2:
                nn.init.normal_(param, 0.0, 0.02)
            elif name.endswith("weight"):  # LayerNorm scale
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (batch, time); greedy when ``temperature=0``."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1].float()
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                next_token = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        return idx

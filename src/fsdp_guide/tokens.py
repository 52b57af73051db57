"""Token batches for the LLM recipe, with a state that can be saved and restored exactly.

Two sources, neither downloaded:

- :func:`python_docs_corpus`: real English text that ships with every Python, the
  documentation topics behind ``help()`` (``pydoc_data.topics``), as bytes;
- :func:`repeating_tokens`: random tokens that repeat with a fixed period, for
  tests and benchmarks (the loss falls as the model memorises them).

:class:`TokenBatches` cuts a global batch of windows from a source and gives each
rank its rows. Batch ``i`` depends only on ``(seed, i)``, so the iterator's whole
state is ``{"seed", "position"}``: restoring it continues the stream exactly, on
any number of ranks (a restarted ``DataLoader`` would start over and repeat data).
"""

from __future__ import annotations

import torch

__all__ = ["TokenBatches", "python_docs_corpus", "repeating_tokens"]


def python_docs_corpus() -> torch.Tensor:
    """The Python documentation's help topics as a 1-D uint8 tensor of UTF-8 bytes (about 0.5 MB).

    >>> corpus = python_docs_corpus()
    >>> corpus.dtype, corpus.numel() > 100_000
    (torch.uint8, True)
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def repeating_tokens(
    seed: int, simulated_size_in_batches: int, batch_size: int, block_size: int, vocab_size: int = 256
):
    """A function ``batch(i)`` of random token rows that starts over after ``simulated_size_in_batches`` batches."""
    if simulated_size_in_batches < 1:
        raise ValueError(f"simulated_size_in_batches={simulated_size_in_batches!r}: expected a positive int")

    def batch(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i % simulated_size_in_batches)
        return torch.randint(vocab_size, (batch_size, block_size + 1), generator=g)

    return batch


def _windows(corpus: torch.Tensor, seed: int, batch_size: int, block_size: int):
    """A function ``batch(i)`` of ``batch_size`` random windows of ``block_size + 1`` tokens from ``corpus``."""
    if corpus.dim() != 1 or corpus.numel() <= block_size + 1:
        raise ValueError(
            f"corpus: expected a 1-D tensor longer than block_size + 1 = {block_size + 1} tokens, "
            f"got shape {tuple(corpus.shape)}"
        )
    offsets = torch.arange(block_size + 1)

    def batch(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        starts = torch.randint(corpus.numel() - block_size - 1, (batch_size, 1), generator=g)
        return corpus[starts + offsets].long()

    return batch


class TokenBatches:
    """``(inputs, targets)`` for this rank: its rows of global batch ``position``, then the next.

    Args:
        corpus: a 1-D tensor of tokens to cut windows from, or ``None`` for
            :func:`repeating_tokens` (then ``simulated_size_in_batches`` sets the period).
        batch_size: rows in the *global* batch, split evenly across ranks.
        rank, world_size: this rank's share (default: one process takes all rows).

    Example:

    >>> batches = TokenBatches(None, batch_size=4, block_size=8, seed=1, simulated_size_in_batches=2)
    >>> first, second, third = next(batches), next(batches), next(batches)
    >>> torch.equal(first[0], third[0]), batches.state_dict()  # period 2
    (True, {'seed': 1, 'position': 3})
    >>> resumed = TokenBatches(None, batch_size=4, block_size=8, simulated_size_in_batches=2)
    >>> resumed.load_state_dict({'seed': 1, 'position': 1})
    >>> torch.equal(next(resumed)[0], second[0])
    True
    >>> rank1 = TokenBatches(None, batch_size=4, block_size=8, seed=1, simulated_size_in_batches=2,
    ...                      rank=1, world_size=2)
    >>> torch.equal(next(rank1)[0], first[0][2:])  # rank 1 of 2 takes rows 2 and 3
    True
    """

    def __init__(
        self,
        corpus: torch.Tensor | None,
        *,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        simulated_size_in_batches: int = 16,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size % world_size:
            raise ValueError(
                f"batch_size={batch_size} does not split evenly over {world_size} ranks: use a multiple of {world_size}"
            )
        self.corpus, self.batch_size, self.block_size = corpus, batch_size, block_size
        self.simulated_size_in_batches = simulated_size_in_batches
        self.rows = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
        self.seed, self.position = seed, 0
        self._reseed()

    def _reseed(self) -> None:
        if self.corpus is None:
            self._batch = repeating_tokens(self.seed, self.simulated_size_in_batches, self.batch_size, self.block_size)
        else:
            self._batch = _windows(self.corpus, self.seed, self.batch_size, self.block_size)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._batch(self.position)[self.rows]
        self.position += 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])
        self._reseed()

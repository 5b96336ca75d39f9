"""Synthetic training data: token sequences walked on a fixed random Markov chain.

The chain is drawn once from the run's seed: every token has a few likely successors, so a model can learn
the next token (the loss falls from log(vocab) toward the chain's entropy). Batches depend only on the
seed, the step and the rank: every rank gets its own shard each step, and every implementation sees the
same tokens.
"""

from __future__ import annotations

import torch

#: Successors per token and how peaked their probabilities are: the chain's entropy is well below log(vocab).
SUCCESSORS = 4
PEAKEDNESS = 2.0


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:  # a fixed mix (not Python's hash): the same numbers on every process and run
        seed = (seed * 1_000_003 + part) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class MarkovTokens:
    """Batches of ``[batch, sequence]`` token ids from one random Markov chain over ``vocab`` tokens."""

    def __init__(self, vocab: int, seed: int):
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        g = _generator(seed, 1)
        self.vocab, self.seed = vocab, seed
        #: [vocab, SUCCESSORS]: each token's possible next tokens (a repeat merges their probabilities) and their
        #: cumulative probabilities
        self.next_tokens = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
        probs = (PEAKEDNESS * torch.randn(vocab, SUCCESSORS, generator=g)).softmax(dim=1)
        self.cumulative = probs.cumsum(dim=1)
        self.cumulative[:, -1] = 1.0  # no draw falls past the last successor through rounding

    def batch(self, step: int, rank: int, batch: int, sequence: int) -> torch.Tensor:
        """Step ``step``'s tokens for ``rank`` (int64 ``[batch, sequence]``, on the CPU)."""
        g = _generator(self.seed, step, rank, 2)
        tokens = torch.empty(batch, sequence, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        draws = torch.rand(sequence, batch, 1, generator=g)  # position-major: each position's draws contiguous
        for t in range(1, sequence):
            current = tokens[:, t - 1]
            pick = torch.searchsorted(self.cumulative[current], draws[t]).squeeze(1)
            tokens[:, t] = self.next_tokens[current, pick]
        return tokens

"""Deterministic training data, addressed by (seed, step, sample index).

The global batch of a step is samples ``0 .. global_batch_size - 1``; micro-batch ``m`` holds
samples ``m * mbs .. (m + 1) * mbs - 1``. Any rank can build any micro-batch on its own, and
resuming at step ``s`` yields the same batches, because a sample depends on nothing but its
address.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

SUCCESSORS = 4
SUCCESSOR_PROBS = np.array([0.7, 0.1, 0.1, 0.1])
_CUMULATIVE = np.cumsum(SUCCESSOR_PROBS)[:-1]  # inverse-CDF sampling: rng.choice is slow


class Corpus(Protocol):
    def samples(self, step: int, indices: np.ndarray) -> np.ndarray:
        """Tokens of samples ``indices`` of step ``step``, shape (len, sample_len), int64."""
        ...


@dataclass(frozen=True, slots=True)
class SyntheticCorpus:
    """Token chains through a fixed sparse random transition table.

    Each token has ``SUCCESSORS`` possible next tokens with fixed probabilities, so the next
    token is learnable (entropy about 0.94 nats, against ln(vocab) for a uniform guess).
    """

    vocab: int
    sample_len: int
    seed: int

    def samples(self, step: int, indices: np.ndarray) -> np.ndarray:
        table = _transition_table(self.vocab, self.seed)
        out = np.empty((len(indices), self.sample_len), dtype=np.int64)
        choices = np.empty((len(indices), self.sample_len), dtype=np.int64)
        for row, index in enumerate(indices):
            rng = np.random.default_rng([self.seed, step, int(index)])
            out[row, 0] = rng.integers(0, self.vocab)
            choices[row] = np.searchsorted(_CUMULATIVE, rng.random(self.sample_len), side="right")
        for pos in range(1, self.sample_len):
            out[:, pos] = table[out[:, pos - 1], choices[:, pos]]
        return out


@functools.cache
def _transition_table(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x7AB1E])
    return rng.integers(0, vocab, size=(vocab, SUCCESSORS))


class TokenFile:
    """A memory-mapped uint16 token file (nanoGPT's format); samples start at seeded offsets."""

    def __init__(self, path: str | Path, sample_len: int, seed: int, vocab: int) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist")
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        if len(self.tokens) <= sample_len:
            raise ValueError(
                f"token file {self.path} has {len(self.tokens)} tokens; "
                f"a sample needs more than {sample_len}"
            )
        self.sample_len, self.seed, self.vocab = sample_len, seed, vocab

    def samples(self, step: int, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), self.sample_len), dtype=np.int64)
        span = len(self.tokens) - self.sample_len
        for row, index in enumerate(indices):
            start = np.random.default_rng([self.seed, step, int(index)]).integers(0, span + 1)
            out[row] = self.tokens[start : start + self.sample_len]
        if out.max(initial=0) >= self.vocab:
            raise ValueError(f"token file {self.path} holds ids >= vocab ({self.vocab})")
        return out


def write_token_file(path: str | Path, tokens: np.ndarray) -> None:
    """Write tokens as a flat uint16 file."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise ValueError("token ids must fit in uint16")
    tokens.astype(np.uint16).tofile(path)


@dataclass(frozen=True, slots=True)
class BatchSource:
    """Micro-batches of a step for a fixed micro-batch size."""

    corpus: Corpus
    micro_batch_size: int

    def micro_batch(self, step: int, mb: int) -> torch.Tensor:
        start = mb * self.micro_batch_size
        indices = np.arange(start, start + self.micro_batch_size)
        return torch.from_numpy(self.corpus.samples(step, indices))

"""Deterministic training data, addressed by (seed, step, sample index).

The global batch of a step is samples ``0 .. global_batch_size - 1``; micro-batch ``m`` holds
samples ``m * mbs .. (m + 1) * mbs - 1``. Any rank can build any micro-batch on its own, and
resuming at step ``s`` yields the same batches, because a sample depends on nothing but its
address.

Three corpora: :class:`SyntheticCorpus`, :class:`TokenFile` (nanoGPT's uint16 file) and
:class:`PackedShards`, the token shards that ``tidal data prepare`` (:mod:`tidal_agent.prepare`)
packs from a local Hugging Face dataset, whose directory format is declared here, beside
their reader.
"""

from __future__ import annotations

import functools
import json
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


# The prepared directory (tidal data prepare): PACKED_META, then shard files, each a flat
# little-endian array of whole samples.
PACKED_META = "meta.json"
PACKED_FORMAT = "tidal-packed-tokens"
PACKED_VERSION = 1
PACKED_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_ORDER_TAG = 0x0D3C  # keeps the epoch permutations' streams apart from other draws of the seed


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


class PackedShards:
    """Samples of a prepared directory, in an order that is a pure function of the address.

    Sample ``index`` of step ``step`` is the ``g = step * global_batch + index``-th sample the
    job reads: pass ``e = g // n`` (n samples) at place ``g % n`` of pass ``e``'s permutation,
    drawn from (seed, e). So every layout and worker count reads the same samples, each pass
    reads each sample once, and resuming at step ``s`` reads on where the run stopped.
    """

    def __init__(self, path: str | Path, sample_len: int, seed: int, vocab: int,
                 global_batch: int) -> None:
        self.path = Path(path)
        meta = _packed_meta(self.path)
        if meta["sample_len"] != sample_len:
            raise ValueError(
                f"training.data: {self.path} was prepared with --seq-len {meta['seq_len']} "
                f"(samples of {meta['sample_len']} tokens); the model's samples have "
                f"{sample_len} (seqLen + 1 + mtpHeads)"
            )
        tokenizer_vocab = meta["tokenizer"]["vocab_size"]
        if tokenizer_vocab > vocab:
            raise ValueError(f"training.data: the tokenizer's vocabulary ({tokenizer_vocab}) "
                             f"exceeds the model's vocab ({vocab})")
        dtype = PACKED_DTYPES[meta["dtype"]]
        self.shards = []
        for shard in meta["shards"]:
            file = self.path / shard["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != shard["samples"] * sample_len * dtype.itemsize:
                raise ValueError(
                    f"training.data: {file} holds {size if size is not None else 'no'} bytes, "
                    f"{PACKED_META} says {shard['samples']} samples of {sample_len} "
                    f"{meta['dtype']}"
                )
            self.shards.append(np.memmap(file, dtype=dtype, mode="r",
                                         shape=(shard["samples"], sample_len)))
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.num_samples = int(self.starts[-1])
        if not self.num_samples:
            raise ValueError(f"training.data: {self.path} holds no samples")
        self.sample_len, self.seed, self.vocab = sample_len, seed, vocab
        self.global_batch = global_batch
        self._orders: dict[int, np.ndarray] = {}

    def order(self, step: int, indices: np.ndarray) -> np.ndarray:
        """The sample numbers (rows of the shards, in order) that the address reads."""
        g = step * self.global_batch + np.asarray(indices, dtype=np.int64)
        epochs, places = np.divmod(g, self.num_samples)
        out = np.empty_like(g)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self._permutation(int(epoch))[places[here]]
        return out

    def samples(self, step: int, indices: np.ndarray) -> np.ndarray:
        rows = self.order(step, indices)
        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows), self.sample_len), dtype=np.int64)
        for shard in np.unique(shard_of):
            here = shard_of == shard
            out[here] = self.shards[shard][rows[here] - self.starts[shard]]
        if out.max(initial=0) >= self.vocab:
            raise ValueError(f"training.data: {self.path} holds ids >= vocab ({self.vocab})")
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a step spans at most two passes, mostly one
                self._orders.pop(min(self._orders))
            rng = np.random.default_rng([self.seed, epoch, _ORDER_TAG])
            self._orders[epoch] = rng.permutation(self.num_samples)
        return self._orders[epoch]


def _packed_meta(path: str | Path) -> dict:
    """The metadata of a prepared directory, checked to be a format this reader knows."""
    file = Path(path) / PACKED_META
    if not file.is_file():
        raise FileNotFoundError(
            f"training.data: {path} is not a prepared directory (no {PACKED_META}): "
            "write one with tidal data prepare"
        )
    meta = json.loads(file.read_text())
    if meta.get("format") != PACKED_FORMAT or meta.get("version") != PACKED_VERSION:
        raise ValueError(
            f"training.data: {file} is not {PACKED_FORMAT} version {PACKED_VERSION} "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r}): prepare it again"
        )
    if meta.get("dtype") not in PACKED_DTYPES:
        raise ValueError(f"training.data: {file}: unknown dtype {meta.get('dtype')!r}")
    return meta


@dataclass(frozen=True, slots=True)
class BatchSource:
    """Micro-batches of a step for a fixed micro-batch size."""

    corpus: Corpus
    micro_batch_size: int

    def micro_batch(self, step: int, mb: int) -> torch.Tensor:
        start = mb * self.micro_batch_size
        indices = np.arange(start, start + self.micro_batch_size)
        return torch.from_numpy(self.corpus.samples(step, indices))

"""Local Hugging Face datasets, tokenized and packed into token shards: ``tidal data prepare``.

Every document (a row's text field; a line of a text file) is tokenized without special tokens
and followed by the end-of-sequence token; the documents, in the source's order, are
concatenated and cut into samples of ``seq_len + 1 + mtp_heads`` tokens (the trainer's
``ModelSpec.sample_len``), the tokens after the last whole sample dropped. The samples go to
shard files with a metadata file (:mod:`tidal_agent.data` declares the format and reads it).

Nothing is downloaded: the dataset is read with the ``datasets`` functions that take local paths
only (``load_from_disk``, ``Dataset.from_parquet/from_json/from_text``, which convert files into
Arrow under a temporary directory in the output), and the tokenizer with
``AutoTokenizer.from_pretrained(dir, local_files_only=True)``. ``datasets`` and
``transformers`` are imported here only, so training never loads them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tidal_agent.data import (
    PACKED_DTYPES,
    PACKED_FORMAT,
    PACKED_META,
    PACKED_VERSION,
    shard_name,
)

SUFFIXES = {"parquet": (".parquet",), "jsonl": (".jsonl", ".json"), "text": (".txt",)}
_BATCH_DOCUMENTS = 1000
_SHARD_PATTERN = "shard-*.bin"
_CACHE_PREFIX = ".prepare-"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PrepareError(ValueError):
    """Input that cannot be prepared; the message is one line that says what to change."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """A local dataset: its format and the files that hold it (the directory, when saved)."""

    path: Path
    format: str
    files: tuple[Path, ...]


def resolve_source(path: Path, fmt: str = "auto") -> Source:
    """The format of ``path`` (from its name or contents when ``fmt`` is auto) and its files."""
    if fmt not in ("auto", "saved", *SUFFIXES):
        raise PrepareError(f"--format {fmt}: not one of auto, saved, {', '.join(SUFFIXES)}")
    if not path.exists():
        raise PrepareError(f"{path}: no such file or directory")
    saved = path.is_dir() and any((path / name).is_file()
                                  for name in ("dataset_dict.json", "state.json"))
    if fmt == "saved" or (fmt == "auto" and saved):
        if not saved:
            raise PrepareError(f"{path}: not a directory that save_to_disk wrote "
                               "(no dataset_dict.json or state.json)")
        return Source(path=path, format="saved", files=(path,))
    if path.is_file():
        found = fmt if fmt != "auto" else _format_of(path)
        if found is None:
            raise PrepareError(f"{path}: cannot tell its format from its name: pass --format "
                               "parquet, jsonl or text")
        return Source(path=path, format=found, files=(path,))
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    kinds = {_format_of(p) for p in files} - {None} if fmt == "auto" else {fmt}
    if len(kinds) > 1:
        raise PrepareError(f"{path} holds {' and '.join(sorted(kinds))} files: pass --format")
    found = next(iter(kinds), None)
    chosen = tuple(p for p in files if found and _format_of(p) == found)
    if not chosen:
        wanted = SUFFIXES.get(found or "", sum(SUFFIXES.values(), ()))
        raise PrepareError(f"{path}: no dataset files in it ({', '.join(wanted)}), and no "
                           "save_to_disk directory")
    return Source(path=path, format=found, files=chosen)


def _format_of(path: Path) -> str | None:
    return next((kind for kind, suffixes in SUFFIXES.items() if path.suffix in suffixes), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerInfo:
    """A local tokenizer directory, loaded: what packing and the trainer need of it."""

    path: Path
    tokenizer: Any
    vocab_size: int  # every id is below it: the model's vocab must be at least this
    eos_id: int


def load_tokenizer(path: Path, eos: str | None = None) -> TokenizerInfo:
    """``path`` through AutoTokenizer (local files only), with its end-of-sequence id: the
    tokenizer's own, or ``eos``'s where given."""
    if not path.is_dir():
        raise PrepareError(f"--tokenizer {path}: no such directory")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise PrepareError(f"--tokenizer {path}: no tokenizer in it (none of "
                           f"{', '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        said = " ".join(str(err).split()) or type(err).__name__  # the library's, on one line
        raise PrepareError(f"--tokenizer {path}: cannot load a tokenizer: {said}") from None
    vocab = tokenizer.get_vocab()
    vocab_size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    if eos is not None:
        if eos not in vocab:
            raise PrepareError(f"--eos {eos!r} is not a token of the tokenizer in {path}")
        eos_id = vocab[eos]
    elif tokenizer.eos_token_id is not None:
        eos_id = tokenizer.eos_token_id
    else:
        raise PrepareError(f"--tokenizer {path} names no end-of-sequence token (eos_token in "
                           "tokenizer_config.json): name one with --eos TOKEN")
    return TokenizerInfo(path=path, tokenizer=tokenizer, vocab_size=vocab_size,
                         eos_id=int(eos_id))


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(kw_only=True, slots=True)
class ShardWriter:
    """Appends token runs and writes whole samples to shard files of ``shard_samples`` each
    (the last may be shorter), hashing what it writes."""

    out: Path
    sample_len: int
    dtype: str
    shard_samples: int
    shards: list[int] = field(default_factory=list)  # samples per written shard
    tokens_in: int = 0
    _pending: list[np.ndarray] = field(default_factory=list)
    _pending_len: int = 0
    _sha: Any = field(default_factory=hashlib.sha256)

    def add(self, tokens: np.ndarray) -> None:
        self._pending.append(tokens)
        self._pending_len += len(tokens)
        self.tokens_in += len(tokens)
        while self._pending_len >= self.shard_samples * self.sample_len:
            self._write(self.shard_samples)

    def close(self) -> int:
        """Write the last whole samples; the number of tokens dropped after them."""
        whole = self._pending_len // self.sample_len
        if whole:
            self._write(whole)
        return self._pending_len

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def _write(self, samples: int) -> None:
        tokens = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        size = samples * self.sample_len
        data = tokens[:size].astype(PACKED_DTYPES[self.dtype])
        data.tofile(self.out / shard_name(len(self.shards)))
        self._sha.update(data)
        self.shards.append(samples)
        self._pending, self._pending_len = [tokens[size:]], len(tokens) - size


def prepare_out(out: Path, *, force: bool) -> bool:
    """Make ``out`` ready to receive shards; whether it was created. An existing directory must
    be empty, or, with ``force``, hold nothing but what a preparation writes (then removed)."""
    if not out.exists():
        if not out.parent.is_dir():
            raise PrepareError(f"--out {out}: the directory {out.parent} does not exist")
        out.mkdir()
        return True
    if not out.is_dir():
        raise PrepareError(f"--out {out}: not a directory")
    entries = list(out.iterdir())
    if not entries:
        return False
    if not force:
        raise PrepareError(f"--out {out} is not empty: pass --force to replace a prepared "
                           "directory, or choose another")
    ours = [p for p in entries if p.name == PACKED_META or p.match(_SHARD_PATTERN)
            or p.name.startswith(_CACHE_PREFIX)]
    others = sorted(p.name for p in entries if p not in ours)
    if others:
        raise PrepareError(f"--out {out} holds files that tidal data prepare did not write "
                           f"({', '.join(others[:3])}): choose another directory")
    for path in sorted(ours, key=lambda p: p.name != PACKED_META):  # the marker first
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return False


Progress = Callable[[int, int], None]  # (documents done, documents in all)


def prepare(source: Source, tokenizer: TokenizerInfo, out: Path, *, seq_len: int,
            mtp_heads: int = 0, text_field: str = "text", split: str | None = None,
            shard_tokens: int, force: bool = False,
            progress: Progress | None = None) -> dict[str, Any]:
    """Tokenize ``source`` and pack it into ``out``; the metadata written (PACKED_META)."""
    sample_len = seq_len + 1 + mtp_heads
    created = prepare_out(out, force=force)
    dtype = token_dtype(tokenizer.vocab_size)
    writer = ShardWriter(out=out, sample_len=sample_len, dtype=dtype,
                         shard_samples=max(1, shard_tokens // sample_len))
    try:
        with tempfile.TemporaryDirectory(prefix=_CACHE_PREFIX, dir=out) as cache:
            dataset, split = _load(source, split, Path(cache))
            _check_text_field(dataset, source, text_field)
            documents = _pack(dataset, text_field, tokenizer, writer, progress)
            dropped = writer.close()
        if not writer.shards:
            raise PrepareError(
                f"{source.path}: {writer.tokens_in} tokens in {documents} documents (end-of-"
                f"sequence tokens included); one sample of --seq-len {seq_len} needs {sample_len}"
            )
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for index in range(len(writer.shards)):
                (out / shard_name(index)).unlink(missing_ok=True)
        raise
    meta = {
        "format": PACKED_FORMAT, "version": PACKED_VERSION, "dtype": dtype,
        "seq_len": seq_len, "mtp_heads": mtp_heads, "sample_len": sample_len,
        "samples": sum(writer.shards), "tokens": writer.tokens_in, "dropped_tokens": dropped,
        "shards": [{"file": shard_name(i), "samples": n} for i, n in enumerate(writer.shards)],
        "sha256": writer.sha256,
        "tokenizer": {"path": str(tokenizer.path.resolve()), "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id},
        "source": {"path": str(source.path.resolve()), "format": source.format,
                   "files": [str(p.relative_to(source.path)) for p in source.files]
                   if source.path.is_dir() else [source.path.name],
                   "split": split, "text_field": text_field, "documents": documents},
    }
    (out / PACKED_META).write_text(json.dumps(meta, indent=2) + "\n")  # last: the marker
    return meta


def _load(source: Source, split: str | None, cache: Path) -> tuple[Any, str | None]:
    """The dataset (one split) and the split's name, where the source has splits."""
    import datasets

    datasets.disable_progress_bars()  # the caller shows one bar, for the whole preparation
    if source.format != "saved":
        if split is not None:
            raise PrepareError(f"--split {split}: {source.path} has no splits (only a "
                               "save_to_disk DatasetDict has)")
        files = [str(p) for p in source.files]
        read = {"parquet": datasets.Dataset.from_parquet, "jsonl": datasets.Dataset.from_json,
                "text": datasets.Dataset.from_text}[source.format]
        return read(files, cache_dir=str(cache)), None
    loaded = datasets.load_from_disk(str(source.path))
    if isinstance(loaded, datasets.Dataset):
        if split is not None:
            raise PrepareError(f"--split {split}: {source.path} is one Dataset, without splits")
        return loaded, None
    names = list(loaded)
    split = split or ("train" if "train" in names or len(names) != 1 else names[0])
    if split not in names:
        raise PrepareError(f"{source.path} has no split {split!r} (it has {', '.join(names)}): "
                           "pass --split")
    return loaded[split], split


def _check_text_field(dataset: Any, source: Source, text_field: str) -> None:
    columns = dataset.column_names
    if text_field not in columns:
        raise PrepareError(f"{source.path}: no column {text_field!r} (it has "
                           f"{', '.join(columns) or 'none'}): pass --text-field")
    feature = dataset.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise PrepareError(f"{source.path}: column {text_field!r} holds {feature}, not text")


def _pack(dataset: Any, text_field: str, tokenizer: TokenizerInfo, writer: ShardWriter,
          progress: Progress | None) -> int:
    """Tokenize the documents in order into ``writer``; the number of documents with text."""
    total, done, documents = len(dataset), 0, 0
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    for batch in dataset.select_columns([text_field]).iter(batch_size=_BATCH_DOCUMENTS):
        texts = batch[text_field]
        done += len(texts)
        texts = [t for t in texts if t]  # None and empty rows are no documents
        if texts:
            ids = tokenizer.tokenizer(texts, add_special_tokens=False, verbose=False,
                                      return_attention_mask=False)["input_ids"]
            writer.add(np.concatenate(list(_with_eos(ids, eos))))
            documents += len(texts)
        if progress is not None:
            progress(done, total)
    return documents


def _with_eos(ids: list[list[int]], eos: np.ndarray) -> Iterable[np.ndarray]:
    for doc in ids:
        yield np.asarray(doc, dtype=np.int64)
        yield eos

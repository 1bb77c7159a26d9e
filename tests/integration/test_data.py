"""``tidal data prepare`` and the corpus it makes: local Hugging Face datasets (saved, parquet,
jsonl, text) tokenized by a local tokenizer, packed into token shards, read in an order that
is a pure function of (seed, step, sample index). The tokenizers are trained here, with
``tokenizers``, on text the tests write."""

import hashlib
import json
import random
import shutil
import socket

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.commands import tidal_here
from tidal_agent.data import BatchSource, PackedShards

WORDS = ("the a cat dog sat ran on under mat far away from near tree house red blue old new "
         "small big green").split()
SEQ_LEN = 7  # samples of 8 tokens
BIG_VOCAB = 70_000  # past uint16


def _documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 25))) for _ in range(count)]


DOCS = _documents(160, 0)


def _save(tokenizer: Tokenizer, path, **special) -> None:
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", **special
                            ).save_pretrained(path)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Tokenizer directories: "bpe" (with <eos>), "no-eos" (the same, naming none) and "big"
    (a word-level vocabulary of BIG_VOCAB words)."""
    root = tmp_path_factory.mktemp("tokenizers")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=100,
                                                      special_tokens=["<unk>", "<eos>"]))
    _save(bpe, root / "bpe", eos_token="<eos>")
    _save(bpe, root / "no-eos")
    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, BIG_VOCAB)}
    big = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _save(big, root / "big", eos_token="<eos>")
    return {name: root / name for name in ("bpe", "no-eos", "big")}


def _expected(tokenizer_dir, docs: list[str]) -> np.ndarray:
    """What prepare must write, computed with the tokenizers library itself: each non-empty
    document's ids, then <eos>."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<eos>")
    encoded = tokenizer.encode_batch([d for d in docs if d], add_special_tokens=False)
    return np.array([i for e in encoded for i in [*e.ids, eos]], dtype=np.int64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """DOCS in each format (with an empty row, which is no document)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sources")
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS[:80])] + [{"text": "", "id": -1}]
    rows += [{"text": d, "id": i} for i, d in enumerate(DOCS[80:], 80)]
    (root / "jsonl").mkdir()  # a directory of two files, read in name order
    for name, part in (("a.jsonl", rows[:50]), ("b.jsonl", rows[50:])):
        (root / "jsonl" / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), root / "docs.parquet")
    (root / "docs.txt").write_text("".join(r["text"] + "\n" for r in rows))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [r["text"] for r in rows]}),
        "validation": datasets.Dataset.from_dict({"text": ["the cat"]}),
    }).save_to_disk(root / "saved")
    return {"jsonl": root / "jsonl", "parquet": root / "docs.parquet",
            "text": root / "docs.txt", "saved": root / "saved"}


@pytest.fixture
def offline(monkeypatch):
    """Refuse and record every connection and name lookup made in this process."""
    tried = []

    def refuse(*args, **kwargs):
        tried.append(args)
        raise OSError("the network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield
    assert tried == [], "prepare tried the network"


def _prepare(source, tokenizer_dir, out, *args, seq_len=SEQ_LEN):
    return tidal_here("data", "prepare", source, "--tokenizer", tokenizer_dir,
                      "--seq-len", seq_len, "--out", out, *args)


def _shard_tokens(out) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    return np.concatenate([np.fromfile(out / s["file"], dtype=dtype) for s in meta["shards"]])


@pytest.fixture(scope="module")
def prepared(tokenizer_dirs, sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "jsonl"
    result = _prepare(sources["jsonl"], tokenizer_dirs["bpe"], out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text", "saved"])
def test_prepare_packs_the_tokenized_documents_in_order(tokenizer_dirs, sources, tmp_path, fmt,
                                                        offline):
    out = tmp_path / "out"
    result = _prepare(sources[fmt], tokenizer_dirs["bpe"], out, "--shard-tokens", 100)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("prepared ")
    tokens, sample_len = _expected(tokenizer_dirs["bpe"], DOCS), SEQ_LEN + 1
    samples = len(tokens) // sample_len
    written = _shard_tokens(out)
    assert np.array_equal(written, tokens[: samples * sample_len])
    meta = json.loads((out / "meta.json").read_text())
    vocab = Tokenizer.from_file(str(tokenizer_dirs["bpe"] / "tokenizer.json")).get_vocab_size()
    assert meta["format"] == "tidal-packed-tokens" and meta["version"] == 1
    assert (meta["dtype"], meta["seq_len"], meta["sample_len"]) == ("uint16", SEQ_LEN, 8)
    assert meta["samples"] == samples and meta["tokens"] == len(tokens)
    assert meta["dropped_tokens"] == len(tokens) - samples * sample_len
    assert [s["samples"] for s in meta["shards"][:-1]] == [100 // 8] * (len(meta["shards"]) - 1)
    assert sum(s["samples"] for s in meta["shards"]) == samples
    assert meta["tokenizer"] == {"path": str(tokenizer_dirs["bpe"].resolve()), "vocab_size": vocab,
                                 "eos_id": 1}
    assert meta["sha256"] == hashlib.sha256(written.astype("<u2").tobytes()).hexdigest()
    assert (meta["source"]["format"], meta["source"]["documents"]) == (fmt, len(DOCS))
    assert meta["source"]["split"] == ("train" if fmt == "saved" else None)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", *(s["file"] for s in meta["shards"])])  # the Arrow cache is gone


def test_a_vocabulary_past_uint16_gets_uint32_shards(tokenizer_dirs, tmp_path, offline):
    docs = [f"w{BIG_VOCAB - 1} w5 w70 w65536", "w2 w3 w65535 w40000"]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    assert _prepare(source, tokenizer_dirs["big"], out, seq_len=2).returncode == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == BIG_VOCAB
    tokens = _expected(tokenizer_dirs["big"], docs)  # 10 tokens: 3 samples of 3, 1 dropped
    assert np.array_equal(_shard_tokens(out), tokens[:9]) and tokens.max() == BIG_VOCAB - 1
    assert (out / "shard-00000.bin").stat().st_size == 9 * 4
    corpus = PackedShards(out, sample_len=3, seed=0, vocab=BIG_VOCAB, global_batch=3)
    assert sorted(map(tuple, corpus.samples(0, np.arange(3)))) == sorted(
        map(tuple, tokens[:9].reshape(3, 3)))
    with pytest.raises(ValueError) as err:
        PackedShards(out, sample_len=3, seed=0, vocab=4096, global_batch=3)
    assert str(err.value) == ("training.data: the tokenizer's vocabulary (70000) exceeds the "
                              "model's vocab (4096)")


def test_sample_order_is_a_function_of_seed_step_and_index(prepared):
    def corpus(seed=5):
        return PackedShards(prepared, sample_len=8, seed=seed, vocab=100, global_batch=12)

    one = corpus()
    whole = one.samples(3, np.arange(12))
    for mbs in (1, 2, 3, 4, 6, 12):  # any micro-batching, any replica's share of them
        source = BatchSource(one, mbs)
        mbs_batch = np.concatenate([source.micro_batch(3, m).numpy() for m in range(12 // mbs)])
        assert np.array_equal(mbs_batch, whole)
    assert np.array_equal(one.samples(3, np.array([7, 2])), whole[[7, 2]])
    assert np.array_equal(corpus().samples(3, np.arange(12)), whole)  # another worker, resumed
    assert not np.array_equal(corpus(seed=6).samples(3, np.arange(12)), whole)
    rows = _shard_tokens(prepared).reshape(-1, 8)
    assert np.array_equal(whole, rows[one.order(3, np.arange(12))])

    n = one.num_samples
    assert n % 12  # so that steps straddle the passes
    order = np.concatenate([one.order(s, np.arange(12)) for s in range(-(-3 * n // 12))])
    passes = [order[e * n:(e + 1) * n] for e in range(3)]
    assert all(np.array_equal(np.sort(p), np.arange(n)) for p in passes)  # each sample once
    assert not np.array_equal(passes[0], passes[1])  # a new order each pass


def test_the_corpus_refuses_data_prepared_for_another_model(prepared, tmp_path):
    with pytest.raises(ValueError) as err:
        PackedShards(prepared, sample_len=9, seed=0, vocab=100, global_batch=4)
    assert str(err.value) == (f"training.data: {prepared} was prepared with --seq-len 7 "
                              "(samples of 8 tokens); the model's samples have 9 "
                              "(seqLen + 1 + mtpHeads)")
    with pytest.raises(FileNotFoundError, match="is not a prepared directory"):
        PackedShards(tmp_path, sample_len=8, seed=0, vocab=100, global_batch=4)
    cut = tmp_path / "cut"
    shutil.copytree(prepared, cut)
    with open(cut / "shard-00000.bin", "r+b") as shard:
        shard.truncate(10)
    with pytest.raises(ValueError, match="shard-00000.bin holds 10 bytes"):
        PackedShards(cut, sample_len=8, seed=0, vocab=100, global_batch=4)


def _one_line_error(result) -> str:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0].removeprefix("Error: ")


def test_prepare_says_what_is_wrong_in_one_line(tokenizer_dirs, sources, tmp_path, offline):
    out, bpe = tmp_path / "out", tokenizer_dirs["bpe"]
    assert _one_line_error(_prepare(tmp_path / "none", bpe, out)) == (
        f"{tmp_path / 'none'}: no such file or directory")
    assert _one_line_error(_prepare(sources["jsonl"], tmp_path / "tok", out)) == (
        f"--tokenizer {tmp_path / 'tok'}: no such directory")
    (tmp_path / "docs.csv").write_text("text\nthe cat\n")
    assert "cannot tell its format from its name: pass --format" in _one_line_error(
        _prepare(tmp_path / "docs.csv", bpe, out))
    assert _one_line_error(_prepare(sources["jsonl"], bpe, out, "--text-field", "body")) == (
        f"{sources['jsonl']}: no column 'body' (it has text, id): pass --text-field")
    assert _one_line_error(_prepare(sources["saved"], bpe, out, "--split", "test")) == (
        f"{sources['saved']} has no split 'test' (it has train, validation): pass --split")
    assert "names no end-of-sequence token" in _one_line_error(
        _prepare(sources["jsonl"], tokenizer_dirs["no-eos"], out))
    small = tmp_path / "small.txt"
    small.write_text("the cat\n")
    assert _one_line_error(_prepare(small, bpe, out, seq_len=64)).endswith(
        "one sample of --seq-len 64 needs 65")
    assert not out.exists()  # a failed preparation leaves nothing


def test_an_existing_output_is_replaced_only_with_force(tokenizer_dirs, sources, tmp_path):
    out = tmp_path / "out"
    assert _prepare(sources["text"], tokenizer_dirs["no-eos"], out, "--eos", "<eos>",
                    "--shard-tokens", 50).returncode == 0
    first = _shard_tokens(out)
    assert "is not empty: pass --force" in _one_line_error(
        _prepare(sources["text"], tokenizer_dirs["bpe"], out))
    assert _prepare(sources["text"], tokenizer_dirs["bpe"], out, "--force").returncode == 0
    assert np.array_equal(_shard_tokens(out), first)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "shard-00000.bin"]
    (out / "notes.txt").write_text("mine")
    assert "holds files that tidal data prepare did not write (notes.txt)" in _one_line_error(
        _prepare(sources["text"], tokenizer_dirs["bpe"], out, "--force"))


def _job_file(tmp_path, data_path, vocab):
    manifest = {
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
        "metadata": {"name": "prepared"},
        "spec": {"workers": {"min": 1, "max": 2},
                 "model": {"layers": 2, "dModel": 32, "heads": 4, "vocab": vocab, "seqLen": 16},
                 "training": {"steps": 3, "globalBatchSize": 8, "microBatchSize": 2,
                              "warmupSteps": 1,
                              "data": {"kind": "prepared", "path": str(data_path)}}},
    }
    path = tmp_path / f"job-{vocab}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.slow
def test_a_prepared_job_trains_with_the_same_bits_at_pp1_and_pp2(tokenizer_dirs, sources, tmp_path):
    data = tmp_path / "data"
    assert _prepare(sources["saved"], tokenizer_dirs["bpe"], data, seq_len=16).returncode == 0
    vocab = json.loads((data / "meta.json").read_text())["tokenizer"]["vocab_size"]
    assert _one_line_error(tidal_here("run", _job_file(tmp_path, data, vocab - 1))) == (
        f"training.data: the tokenizer's vocabulary ({vocab}) exceeds the model's vocab "
        f"({vocab - 1})")
    job, runs = _job_file(tmp_path, data, 128), []
    for workers in (1, 2):
        report = tmp_path / f"report-{workers}.json"
        result = tidal_here("run", job, "--workers", workers, "--schedule", "1f1b",
                            "--report", report)
        assert result.returncode == 0, result.stderr
        runs.append(json.loads(report.read_text()))
    assert [r["layouts"][0]["layout"]["pp"] for r in runs] == [1, 2]
    losses = [[s["loss_hex"] for s in r["steps"]] for r in runs]
    assert losses[0] == losses[1] and len(set(losses[0])) == 3
    assert runs[0]["params_sha256"] == runs[1]["params_sha256"]

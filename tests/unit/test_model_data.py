import numpy as np
import pytest
import torch

from tidal_agent.data import BatchSource, SyntheticCorpus, TokenFile, write_token_file
from tidal_agent.model import StageModule, global_parameter_names
from tidal_api import ModelSpec

torch.set_num_threads(1)
MODEL = ModelSpec(layers=3, d_model=16, heads=2, vocab=32, seq_len=8, mtp_heads=2)


def test_initial_values_do_not_depend_on_placement():
    whole = dict(StageModule(MODEL, range(MODEL.num_units), seed=3).named_parameters())
    parts = {}
    for units in (range(0, 2), range(2, 5), range(5, 7)):
        parts.update(dict(StageModule(MODEL, units, seed=3).named_parameters()))
    assert list(parts) == list(whole) == global_parameter_names(MODEL)
    assert all(torch.equal(parts[n], whole[n]) for n in whole)
    other = dict(StageModule(MODEL, range(MODEL.num_units), seed=4).named_parameters())
    assert not torch.equal(other["blocks.1.mlp.fc1.weight"], whole["blocks.1.mlp.fc1.weight"])


def test_synthetic_samples_are_addressed_not_sequenced():
    corpus = SyntheticCorpus(vocab=50, sample_len=12, seed=1)
    batch = corpus.samples(5, np.arange(8))
    assert np.array_equal(corpus.samples(5, np.array([6, 2])), batch[[6, 2]])
    assert not np.array_equal(corpus.samples(6, np.arange(8)), batch)
    assert batch.min() >= 0 and batch.max() < 50


def test_synthetic_corpus_has_learnable_structure():
    corpus = SyntheticCorpus(vocab=64, sample_len=64, seed=0)
    tokens = corpus.samples(0, np.arange(200))
    pairs = {}
    for row in tokens:
        for a, b in zip(row[:-1], row[1:], strict=False):
            pairs.setdefault(int(a), set()).add(int(b))
    # each token is followed by at most 4 distinct tokens, far fewer than the vocabulary
    assert max(len(v) for v in pairs.values()) <= 4


def test_token_file_round_trip(tmp_path):
    path = tmp_path / "tokens.bin"
    write_token_file(path, np.arange(1000) % 97)
    source = BatchSource(TokenFile(path, sample_len=10, seed=2, vocab=97), micro_batch_size=3)
    mb = source.micro_batch(step=4, mb=1)
    assert mb.shape == (3, 10) and mb.dtype == torch.int64
    assert torch.equal(mb, source.micro_batch(step=4, mb=1))
    diffs = (mb[:, 1:] - mb[:, :-1]) % 97
    assert bool((diffs == 1).all())  # consecutive tokens of the file


def test_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        TokenFile(tmp_path / "none.bin", sample_len=4, seed=0, vocab=10)
    path = tmp_path / "short.bin"
    write_token_file(path, np.arange(3))
    with pytest.raises(ValueError, match="a sample needs more than 4"):
        TokenFile(path, sample_len=4, seed=0, vocab=10)


def test_logical_replicas_add_in_a_tree_not_in_sequence():
    """Four logical replicas whose gradients are 1e8, 1, -1e8, 1 (float32): in sequence they
    add to 1, in the tree (1e8 + 1) + (-1e8 + 1) to 0. A block of two, as one of two data-parallel
    replicas runs it, ends with its own subtree."""
    import torch

    from tidal_agent.optim import LogicalReplicaGradients

    values = [1e8, 1.0, -1e8, 1.0]
    param = torch.nn.Parameter(torch.zeros(1))
    whole = LogicalReplicaGradients({0: [param]}, per_replica=2, mb_offset=0)
    for mb in range(8):  # two micro-batches per logical replica, half the value each
        grad = torch.tensor([values[mb // 2] / 2])  # as autograd accumulates
        param.grad = grad if param.grad is None else param.grad + grad
        whole.micro_batch_done(0, mb)
    whole.finish()
    assert param.grad.item() == 0.0
    assert sum(torch.tensor([v], dtype=torch.float32) for v in values).item() == 1.0

    param.grad = None
    second = LogicalReplicaGradients({0: [param]}, per_replica=2, mb_offset=4)
    for mb in range(4):  # the second replica's micro-batches 4..7: logical replicas 2 and 3
        grad = torch.tensor([values[2 + mb // 2] / 2])
        param.grad = grad if param.grad is None else param.grad + grad
        second.micro_batch_done(0, mb)
    second.finish()
    assert param.grad.item() == -1e8  # -1e8 + 1 rounds to -1e8


def test_an_uneven_block_of_logical_replicas_ends_as_several_subtrees():
    """Logical replicas 1..3 of four (a share that starts off the tree's alignment): replica 1
    stays alone (its left sibling is elsewhere), 2 and 3 add into their parent."""
    import torch

    from tidal_agent.optim import LogicalReplicaGradients

    param = torch.nn.Parameter(torch.zeros(1))
    block = LogicalReplicaGradients({0: [param]}, per_replica=2, mb_offset=2)
    for mb in range(6):
        grad = torch.tensor([float(10 ** (1 + mb // 2))])
        param.grad = grad if param.grad is None else param.grad + grad
        block.micro_batch_done(0, mb)
    assert param.grad is None
    assert [(level, index, [g.item() for g in grads]) for level, index, grads in block.take()] == [
        (0, 1, [20.0]), (1, 1, [2200.0])]

"""Reshard planner: minimal, complete, balanced and deterministic transfers, bounded buckets.

The property tests check the planner against a brute force over plain sets of
(tensor, element) pairs, computed from the layouts without the planner's helpers.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_api.layout import Layout, ScheduleKind
from tidal_plan import reshard
from tidal_plan.reshard import (
    Placement,
    Region,
    ReshardError,
    ReshardPlan,
    TensorMeta,
    Transfer,
    bucketize,
    plan_reshard,
)


def layout(partition: tuple[int, ...], *, pp: int | None = None, dp: int = 1) -> Layout:
    pp = pp or len(partition)
    virtual = len(partition) // pp
    return Layout(
        pp=pp,
        dp=dp,
        partition=partition,
        micro_batch_size=1,
        num_micro_batches=4,
        schedule=ScheduleKind.INTERLEAVED if virtual > 1 else ScheduleKind.ONE_F_ONE_B,
        virtual_stages=virtual,
    )


def worker_id(i: int) -> str | int:
    # Mixed id types: the planner must never order workers by id.
    return i if i % 2 else f"pod-{i}"


@st.composite
def layouts(draw, units: int) -> Layout:
    pp = draw(st.integers(1, min(units, 4)))
    virtual = draw(st.integers(1, 2)) if 2 * pp <= units else 1
    stages = pp * virtual
    cut_points = st.sets(st.integers(1, units - 1), min_size=stages - 1, max_size=stages - 1)
    cuts = sorted(draw(cut_points))
    edges = [0, *cuts, units]
    partition = tuple(b - a for a, b in zip(edges, edges[1:]))
    return layout(partition, pp=pp, dp=draw(st.integers(1, 3)))


@st.composite
def switches(draw) -> tuple[Placement, Placement, list[TensorMeta]]:
    units = draw(st.integers(2, 12))
    old_layout, new_layout = draw(layouts(units)), draw(layouts(units))
    n_old, n_new = old_layout.world_size, new_layout.world_size
    pool = [worker_id(i) for i in range(n_old + n_new)]
    old_workers = draw(st.permutations(pool))[:n_old]
    # New workers drawn from the same pool overlap the old ones partly: keepers, joiners, leavers.
    new_workers = draw(st.permutations(pool))[:n_new]
    tensors = []
    for unit in range(units):
        for k in range(draw(st.integers(1, 3))):
            tensors.append(
                TensorMeta(
                    name=f"u{unit}.t{k}",
                    unit=unit,
                    numel=draw(st.integers(0, 20)),
                    itemsize=draw(st.sampled_from([1, 2, 4])),
                )
            )
    for k in range(draw(st.integers(0, 2))):
        numel = draw(st.integers(1, 4))
        tensors.append(TensorMeta(name=f"rng{k}", unit=None, numel=numel, itemsize=8))
    tensors = draw(st.permutations(tensors))
    return (
        Placement(layout=old_layout, workers=old_workers),
        Placement(layout=new_layout, workers=new_workers),
        list(tensors),
    )


def held_elements(placement: Placement, tensors: list[TensorMeta]) -> dict:
    """worker -> {(tensor, element)}, straight from the layout's stage arithmetic."""
    lay = placement.layout
    held = {}
    for index, worker in enumerate(placement.workers):
        rank = index % lay.pp
        units = {u for s in lay.rank_stages(rank) for u in lay.stage_units(s)}
        held[worker] = {
            (t.name, e)
            for t in tensors
            if t.unit is None or t.unit in units
            for e in range(t.numel)
        }
    return held


def check_plan(
    plan: ReshardPlan, old: Placement, new: Placement, tensors: list[TensorMeta]
) -> None:
    had, need = held_elements(old, tensors), held_elements(new, tensors)
    itemsize = {t.name: t.itemsize for t in tensors}
    missing = {w: need[w] - had.get(w, set()) for w in new.workers}
    brute = sum(itemsize[name] for elements in missing.values() for name, _ in elements)
    assert plan.bytes_moved == plan.bytes_min == brute

    received = Counter()
    for t in plan.transfers:
        elements = {(t.tensor, e) for e in range(t.region.start, t.region.stop)}
        assert t.nbytes == t.region.numel * itemsize[t.tensor]
        assert elements <= had[t.src], f"{t} sends what its source never held"
        for element in elements:
            received[t.dst, element] += 1
    assert all(count == 1 for count in received.values()), "an element is received twice"
    for worker in new.workers:
        got = {element for (dst, element) in received if dst == worker}
        assert got == missing[worker], f"{worker!r} receives more or less than it lacks"
        assert (had.get(worker, set()) & need[worker]) | got == need[worker]

    assert plan.joiners == tuple(w for w in new.workers if w not in old.workers)
    assert plan.leavers == tuple(w for w in old.workers if w not in new.workers)
    assert plan.keepers == tuple(w for w in new.workers if w in old.workers)


@settings(max_examples=300, deadline=None)
@given(switch=switches(), threshold=st.sampled_from([0, 8, 32, 1 << 20]))
def test_plan_moves_exactly_what_changes_owner(switch, threshold):
    old, new, tensors = switch
    plan = plan_reshard(old, new, tensors, split_threshold_bytes=threshold)
    check_plan(plan, old, new, tensors)

    order = {t.name: i for i, t in enumerate(tensors)}
    keys = [(order[t.tensor], t.region.start, new.position(t.dst)) for t in plan.transfers]
    assert keys == sorted(keys)
    assert plan_reshard(old, new, list(tensors), split_threshold_bytes=threshold) == plan


@settings(max_examples=200, deadline=None)
@given(switch=switches(), cap=st.integers(8, 64))
def test_buckets_bound_bytes_per_worker_and_keep_every_byte(switch, cap):
    old, new, tensors = switch
    plan = plan_reshard(old, new, tensors, split_threshold_bytes=16)
    buckets = bucketize(plan, cap)
    pieces = [t for bucket in buckets for t in bucket]
    assert sum(t.nbytes for t in pieces) == plan.bytes_moved
    for bucket in buckets:
        assert bucket, "empty bucket"
        sent, received = Counter(), Counter()
        for t in bucket:
            sent[t.src] += t.nbytes
            received[t.dst] += t.nbytes
        assert max(sent.values()) <= cap and max(received.values()) <= cap
    # Pieces tile the original transfers: same elements between the same pair, none twice.
    def elements(transfers):
        return Counter(
            (t.src, t.dst, t.tensor, e)
            for t in transfers
            for e in range(t.region.start, t.region.stop)
        )
    assert elements(pieces) == elements(plan.transfers)
    assert all(n == 1 for n in elements(pieces).values())
    assert bucketize(plan, cap) == buckets


def test_oversize_transfer_is_cut_into_pieces_under_the_cap():
    big = Transfer(src="a", dst="b", tensor="w", region=Region(start=10, stop=35), nbytes=100)
    plan = ReshardPlan(transfers=(big,), bytes_min=100, joiners=("b",), leavers=(), keepers=("a",))
    buckets = bucketize(plan, 32)
    assert [[(t.region.start, t.region.stop, t.nbytes) for t in b] for b in buckets] == [
        [(10, 18, 32)], [(18, 26, 32)], [(26, 34, 32)], [(34, 35, 4)]
    ]


def test_transfers_that_fit_share_one_bucket():
    old = Placement(layout=layout((2,), dp=2), workers=("a", "b"))
    new = Placement(layout=layout((1, 1), dp=2), workers=("a", "c", "b", "d"))
    tensors = [TensorMeta(name=f"u{u}", unit=u, numel=4, itemsize=4) for u in range(2)]
    plan = plan_reshard(old, new, tensors)
    assert len(plan.transfers) == 2
    assert bucketize(plan, 16) == [plan.transfers]


def test_bucket_cap_below_one_element_says_how_to_fix():
    t = Transfer(src="a", dst="b", tensor="w", region=Region(start=0, stop=4), nbytes=32)
    plan = ReshardPlan(transfers=(t,), bytes_min=32, joiners=(), leavers=(), keepers=("a", "b"))
    with pytest.raises(ReshardError, match="raise the bucket cap to at least 8"):
        bucketize(plan, 4)


def test_worked_example_pp2_to_pp3():
    # Old: a holds units 0-2, b holds 3-5. New: a 0-1, b 2-3, c (joiner) 4-5.
    old = Placement(layout=layout((3, 3)), workers=("a", "b"))
    new = Placement(layout=layout((2, 2, 2)), workers=("a", "b", "c"))
    tensors = [TensorMeta(name=f"u{u}.w", unit=u, numel=10, itemsize=4) for u in range(6)]
    tensors.append(TensorMeta(name="rng", unit=None, numel=2, itemsize=8))
    plan = plan_reshard(old, new, tensors)

    def move(src, dst, name, numel, nbytes):
        return Transfer(src=src, dst=dst, tensor=name, region=Region(start=0, stop=numel),
                        nbytes=nbytes)

    assert plan.transfers == (
        move("a", "b", "u2.w", 10, 40),
        move("b", "c", "u4.w", 10, 40),
        move("b", "c", "u5.w", 10, 40),
        # a has sent 40 bytes, b 80: the replicated state comes from a.
        move("a", "c", "rng", 2, 16),
    )
    assert plan.bytes_moved == plan.bytes_min == 136
    assert (plan.joiners, plan.leavers, plan.keepers) == (("c",), (), ("a", "b"))


def test_sources_are_balanced_over_replicas():
    # Two old replicas hold everything; the joiner c needs 20 equal tensors.
    old = Placement(layout=layout((8,), dp=2), workers=("a", "b"))
    new = Placement(layout=layout((4, 4)), workers=("a", "c"))
    tensors = [TensorMeta(name=f"u{u}.t{k}", unit=u, numel=100, itemsize=4)
               for u in range(8) for k in range(5)]
    plan = plan_reshard(old, new, tensors)
    sent = Counter()
    for t in plan.transfers:
        assert t.dst == "c"
        sent[t.src] += t.nbytes
    assert plan.bytes_moved == 20 * 400
    assert set(sent) == {"a", "b"} and abs(sent["a"] - sent["b"]) <= 400
    assert plan.leavers == ("b",)


def test_large_tensor_is_split_across_replicas():
    old = Placement(layout=layout((2,), dp=3), workers=("a", "b", "c"))
    new = Placement(layout=layout((1, 1)), workers=("a", "d"))
    tensors = [TensorMeta(name="u1.w", unit=1, numel=1000, itemsize=4)]
    plan = plan_reshard(old, new, tensors, split_threshold_bytes=1024)
    assert [(t.src, t.region.start, t.region.stop) for t in plan.transfers] == [
        ("a", 0, 334), ("b", 334, 667), ("c", 667, 1000)
    ]
    whole = plan_reshard(old, new, tensors, split_threshold_bytes=4000)
    assert [(t.src, t.region.numel) for t in whole.transfers] == [("a", 1000)]


def test_unchanged_placement_moves_nothing():
    p = Placement(layout=layout((2, 3), dp=2), workers=(1, 2, 3, 4))
    tensors = [TensorMeta(name=f"u{u}", unit=u, numel=5, itemsize=2) for u in range(5)]
    plan = plan_reshard(p, p, tensors)
    assert plan.transfers == () and plan.bytes_min == 0 and plan.keepers == (1, 2, 3, 4)


def test_sharded_holdings_are_intersected_by_region(monkeypatch):
    # A ZeRO-like future: each replica holds a slice, so the planner must cut by region.
    def sharded(placement, tensor):
        if placement.layout.dp == 1:
            return {w: (Region(start=0, stop=tensor.numel),) for w in placement.workers}
        a, b = placement.workers
        return {a: (Region(start=0, stop=6),), b: (Region(start=4, stop=10),)}

    monkeypatch.setattr(reshard, "_held", sharded)
    old = Placement(layout=layout((1,), dp=2), workers=("a", "b"))
    new = Placement(layout=layout((1,)), workers=("a",))
    plan = plan_reshard(old, new, [TensorMeta(name="w", unit=0, numel=10, itemsize=1)])
    assert [(t.src, t.region.start, t.region.stop) for t in plan.transfers] == [("b", 6, 10)]

    gone = {"a": (Region(start=0, stop=3),), "b": (Region(start=5, stop=10),)}
    monkeypatch.setattr(reshard, "_held", lambda p, t: gone if p.layout.dp == 2 else sharded(p, t))
    new = Placement(layout=layout((1,)), workers=("c",))
    with pytest.raises(ReshardError, match=r"elements \[3, 5\) of tensor 'w' .* no worker holds"):
        plan_reshard(old, new, [TensorMeta(name="w", unit=0, numel=10, itemsize=1)])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: plan_reshard(
            Placement(layout=layout((3, 3)), workers=("a", "b")),
            Placement(layout=layout((2, 2, 3)), workers=("a", "b", "c")),
            [],
        ), "covers 6 units but new layout .* covers 7: both must partition the same model"),
        (lambda: plan_reshard(
            Placement(layout=layout((3, 3)), workers=("a", "b")),
            Placement(layout=layout((2, 4)), workers=("a", "b")),
            [TensorMeta(name="u9.w", unit=9, numel=1, itemsize=4)],
        ), "belongs to unit 9 but the layouts cover units 0..5"),
        (lambda: plan_reshard(
            Placement(layout=layout((3, 3)), workers=("a", "b")),
            Placement(layout=layout((3, 3)), workers=("a", "b")),
            [TensorMeta(name="w", unit=0, numel=1, itemsize=4)] * 2,
        ), "'w' is listed twice"),
        (lambda: Placement(layout=layout((1, 1), dp=2), workers=("a", "b", "c")),
         "4 positions but 3 workers"),
        (lambda: Placement(layout=layout((1, 1)), workers=("a", "a")), "'a' appear more than once"),
        (lambda: TensorMeta(name="w", unit=0, numel=-1, itemsize=4), "numel must be at least 0"),
    ],
)
def test_impossible_reshards_say_how_to_fix(build, message):
    with pytest.raises(ReshardError, match=message):
        build()


def test_placement_positions_and_holders():
    p = Placement(layout=layout((1, 2, 2, 1), pp=2, dp=2), workers=("a", "b", "c", "d"))
    assert p.position("c") == (1, 0) and p.position("b") == (0, 1)
    # Interleaved: stages 0 and 2 (units 0, 3, 4) on rank 0; stages 1 and 3 on rank 1.
    assert p.holders(0) == p.holders(4) == ("a", "c")
    assert p.holders(2) == p.holders(5) == ("b", "d")
    with pytest.raises(ReshardError, match="'z' has no position"):
        p.position("z")

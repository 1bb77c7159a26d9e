"""Reshard planning: the fewest bytes that move training state from one placement to the next.

The hot switch (DESIGN.md section 2) changes who holds which state tensor. This module decides,
from metadata alone, which worker sends which elements of which tensor to whom, and cuts those
transfers into buckets the executor can run as batched P2P. It moves nothing itself.

The planner works over element regions, not whole tensors: a worker receives what it needs in the
new placement minus what it already held in the old one, taken from the old holders of exactly
those elements. Today every tensor is held whole (pipeline stages own whole units), so only
``_held`` knows that; a sharded layout (ZeRO, TP) changes ``_held`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from tidal_api.layout import Layout

WorkerId: TypeAlias = str | int
"""A process's stable identity across layouts (e.g. its pod name)."""

DEFAULT_SPLIT_THRESHOLD_BYTES = 1 << 20


class ReshardError(ValueError):
    """A reshard that cannot be planned; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """A layout bound to workers: ``workers[replica * pp + pp_rank]`` runs that position."""

    layout: Layout
    workers: tuple[WorkerId, ...]
    _index: dict[WorkerId, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        workers = tuple(self.workers)
        object.__setattr__(self, "workers", workers)
        layout = self.layout
        if len(workers) != layout.world_size:
            raise ReshardError(
                f"layout {layout.describe()} has dp {layout.dp} x pp {layout.pp} = "
                f"{layout.world_size} positions but {len(workers)} workers were given: "
                f"list one worker per position, index = replica * pp + pp_rank"
            )
        index = {worker: i for i, worker in enumerate(workers)}
        if len(index) != len(workers):
            twice = sorted({repr(w) for w in workers if workers.count(w) > 1})
            raise ReshardError(
                f"workers {', '.join(twice)} appear more than once: a worker runs one position"
            )
        object.__setattr__(self, "_index", index)

    def position(self, worker: WorkerId) -> tuple[int, int]:
        """``(replica, pp_rank)`` of ``worker``."""
        if worker not in self._index:
            raise ReshardError(f"worker {worker!r} has no position in this placement")
        return divmod(self._index[worker], self.layout.pp)

    def holders(self, unit: int) -> tuple[WorkerId, ...]:
        """The workers, one per replica in replica order, whose pipeline rank holds ``unit``."""
        layout = self.layout
        rank = layout.stage_rank(layout.unit_stage(unit))
        return tuple(self.workers[replica * layout.pp + rank] for replica in range(layout.dp))


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """One state tensor, described by metadata only.

    ``unit`` is the placement unit that owns it (its parameters and their optimizer state);
    ``None`` marks state every worker holds (scheduler position, RNG counters).
    """

    name: str
    unit: int | None
    numel: int
    itemsize: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ReshardError("a state tensor needs a name")
        if self.unit is not None and self.unit < 0:
            raise ReshardError(f"tensor {self.name!r} has unit {self.unit}: units count from 0")
        if self.numel < 0 or self.itemsize < 1:
            raise ReshardError(
                f"tensor {self.name!r} has numel {self.numel} and itemsize {self.itemsize}: "
                f"numel must be at least 0 and itemsize at least 1 byte"
            )

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """Elements ``[start, stop)`` of a tensor's flattened storage; never empty."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ReshardError(
                f"region [{self.start}, {self.stop}) is empty or negative: need 0 <= start < stop"
            )

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def intersect(self, other: Region) -> Region | None:
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Region(start=start, stop=stop) if start < stop else None

    def split(self, parts: int) -> tuple[Region, ...]:
        """``parts`` contiguous pieces as even as possible, larger first; fewer if too short."""
        parts = max(1, min(parts, self.numel))
        base, extra = divmod(self.numel, parts)
        pieces, start = [], self.start
        for i in range(parts):
            stop = start + base + (1 if i < extra else 0)
            pieces.append(Region(start=start, stop=stop))
            start = stop
        return tuple(pieces)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """``src`` sends elements ``region`` of ``tensor`` to ``dst``."""

    src: WorkerId
    dst: WorkerId
    tensor: str
    region: Region
    nbytes: int

    def __post_init__(self) -> None:
        if self.src == self.dst:
            raise ReshardError(f"transfer of {self.tensor!r} from {self.src!r} to itself")
        if self.nbytes < 1 or self.nbytes % self.region.numel:
            raise ReshardError(
                f"transfer of {self.tensor!r} has {self.nbytes} bytes for "
                f"{self.region.numel} elements: nbytes must be numel x itemsize"
            )

    @property
    def itemsize(self) -> int:
        return self.nbytes // self.region.numel


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardPlan:
    """The transfers of one layout switch and who joins, leaves or stays.

    ``bytes_min`` counts, for every new worker, the bytes it needs and did not hold before; a plan
    from ``plan_reshard`` moves exactly that (``bytes_moved == bytes_min``).
    """

    transfers: tuple[Transfer, ...]
    bytes_min: int
    joiners: tuple[WorkerId, ...]
    leavers: tuple[WorkerId, ...]
    keepers: tuple[WorkerId, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)


def plan_reshard(
    old: Placement,
    new: Placement,
    tensors: Sequence[TensorMeta],
    *,
    split_threshold_bytes: int = DEFAULT_SPLIT_THRESHOLD_BYTES,
) -> ReshardPlan:
    """The minimal transfers that give every worker of ``new`` its state, taken from ``old``.

    A worker receives only the elements it needs and did not hold; each is sent once. Among old
    holders of the same elements (DP replicas) the one that has sent the fewest bytes so far
    sends, ties going to the earlier old position; a region larger than
    ``split_threshold_bytes`` is cut into contiguous pieces across all its holders. Leavers are
    ordinary sources: their state must leave before they exit. The same inputs give the same
    plan; transfers are ordered by (tensor order in ``tensors``, region start, new position).
    """
    _check_compatible(old, new, tensors)
    sent = {worker: 0 for worker in old.workers}
    transfers: list[Transfer] = []
    bytes_min = 0
    for tensor in tensors:
        had = _held(old, tensor)
        for dst, wanted in _held(new, tensor).items():
            for want in wanted:
                for missing in _subtract(want, had.get(dst, ())):
                    bytes_min += missing.numel * tensor.itemsize
                    for piece, sources in _covered_pieces(tensor, missing, had):
                        ranked = sorted(sources, key=lambda w: (sent[w], old.position(w)))
                        transfers.extend(
                            _assign(tensor, dst, piece, ranked, sent, split_threshold_bytes)
                        )
    order = {tensor.name: i for i, tensor in enumerate(tensors)}
    transfers.sort(key=lambda t: (order[t.tensor], t.region.start, new.position(t.dst)))
    return ReshardPlan(
        transfers=tuple(transfers),
        bytes_min=bytes_min,
        joiners=tuple(w for w in new.workers if w not in old._index),
        leavers=tuple(w for w in old.workers if w not in new._index),
        keepers=tuple(w for w in new.workers if w in old._index),
    )


def bucketize(plan: ReshardPlan, cap_bytes: int) -> list[tuple[Transfer, ...]]:
    """Group the plan's transfers into buckets that bound every worker's bytes in flight.

    In each bucket every worker sends at most ``cap_bytes`` and, separately, receives at most
    ``cap_bytes``; a transfer larger than the cap is cut into region pieces of at most
    ``cap_bytes``. Transfers go, in plan order, into the first bucket with room (first fit).

    Deadlock freedom. The bucket list is a pure function of the plan, so every worker computes the
    same list and walks it in the same order. For bucket ``i`` a worker posts all of its sends and
    receives of that bucket at once (batched, non-blocking P2P), waits for them, then moves to
    ``i + 1``; a worker with nothing in a bucket skips it. Every operation posted in bucket ``i``
    has its partner in bucket ``i`` on the other worker, so, by induction on ``i``, once all
    workers have finished bucket ``i - 1`` every operation of bucket ``i`` finds its partner
    posted and completes: no worker waits on one that waits in an earlier or later bucket, and
    within a bucket nothing waits because nothing blocks before the whole batch is posted.
    Between one pair of workers both sides post their operations in the same (bucket, plan)
    order, so FIFO matching pairs each send with its receive without tags.
    """
    if cap_bytes < 1:
        raise ReshardError(f"cap_bytes ({cap_bytes}) must be at least 1")
    buckets: list[list[Transfer]] = []
    sent: list[dict[WorkerId, int]] = []
    received: list[dict[WorkerId, int]] = []
    for transfer in plan.transfers:
        for piece in _pieces(transfer, cap_bytes):
            for bucket, out, into in zip(buckets, sent, received):
                if (
                    out.get(piece.src, 0) + piece.nbytes <= cap_bytes
                    and into.get(piece.dst, 0) + piece.nbytes <= cap_bytes
                ):
                    break
            else:
                bucket, out, into = [], {}, {}
                buckets.append(bucket)
                sent.append(out)
                received.append(into)
            bucket.append(piece)
            out[piece.src] = out.get(piece.src, 0) + piece.nbytes
            into[piece.dst] = into.get(piece.dst, 0) + piece.nbytes
    return [tuple(bucket) for bucket in buckets]


def _held(placement: Placement, tensor: TensorMeta) -> dict[WorkerId, tuple[Region, ...]]:
    """The regions of ``tensor`` each worker holds, in position order.

    The one place that knows how a layout shards state: pipeline stages hold their units'
    tensors whole, and replicated state is on every worker.
    """
    if tensor.numel == 0:
        return {}
    whole = (Region(start=0, stop=tensor.numel),)
    holders = placement.workers if tensor.unit is None else placement.holders(tensor.unit)
    return {worker: whole for worker in holders}


def _subtract(want: Region, have: Sequence[Region]) -> list[Region]:
    """The parts of ``want`` outside every region of ``have``, in element order."""
    left, start = [], want.start
    overlaps = (cut for r in have if (cut := r.intersect(want)) is not None)
    for cut in sorted(overlaps, key=lambda r: r.start):
        if cut.start > start:
            left.append(Region(start=start, stop=cut.start))
        start = max(start, cut.stop)
    if start < want.stop:
        left.append(Region(start=start, stop=want.stop))
    return left


def _covered_pieces(
    tensor: TensorMeta, missing: Region, had: Mapping[WorkerId, Sequence[Region]]
) -> Iterator[tuple[Region, tuple[WorkerId, ...]]]:
    """Cut ``missing`` where its set of old holders changes; yield each piece with its holders."""
    cuts = {missing.start, missing.stop}
    for regions in had.values():
        ends = (e for r in regions for e in (r.start, r.stop))
        cuts.update(e for e in ends if missing.start < e < missing.stop)
    edges = sorted(cuts)
    run: tuple[Region, tuple[WorkerId, ...]] | None = None
    for start, stop in zip(edges, edges[1:]):
        holders = tuple(
            worker
            for worker, regions in had.items()
            if any(r.start <= start and stop <= r.stop for r in regions)
        )
        if not holders:
            raise ReshardError(
                f"elements [{start}, {stop}) of tensor {tensor.name!r} (unit {tensor.unit}) are "
                f"needed in the new placement but no worker holds them in the old one: restore "
                f"them from a checkpoint or keep a holder in the old placement"
            )
        if run is not None and run[1] == holders:
            run = (Region(start=run[0].start, stop=stop), holders)
            continue
        if run is not None:
            yield run
        run = (Region(start=start, stop=stop), holders)
    if run is not None:
        yield run


def _assign(
    tensor: TensorMeta,
    dst: WorkerId,
    piece: Region,
    ranked: Sequence[WorkerId],
    sent: dict[WorkerId, int],
    split_threshold_bytes: int,
) -> Iterator[Transfer]:
    """Send ``piece`` from the least-loaded holder, or split across all if it is large."""
    # Splitting a small region only adds per-message latency; a large one is bandwidth-bound
    # and goes faster drawn from every replica at once.
    big = piece.numel * tensor.itemsize > split_threshold_bytes
    parts = piece.split(len(ranked)) if big else (piece,)
    for part, src in zip(parts, ranked):
        nbytes = part.numel * tensor.itemsize
        sent[src] += nbytes
        yield Transfer(src=src, dst=dst, tensor=tensor.name, region=part, nbytes=nbytes)


def _pieces(transfer: Transfer, cap_bytes: int) -> Iterator[Transfer]:
    """``transfer`` cut into contiguous pieces of at most ``cap_bytes``."""
    if transfer.nbytes <= cap_bytes:
        yield transfer
        return
    itemsize = transfer.itemsize
    if itemsize > cap_bytes:
        raise ReshardError(
            f"cap_bytes ({cap_bytes}) is smaller than one element of {transfer.tensor!r} "
            f"({itemsize} bytes): raise the bucket cap to at least {itemsize}"
        )
    step = cap_bytes // itemsize
    for start in range(transfer.region.start, transfer.region.stop, step):
        region = Region(start=start, stop=min(start + step, transfer.region.stop))
        yield Transfer(
            src=transfer.src,
            dst=transfer.dst,
            tensor=transfer.tensor,
            region=region,
            nbytes=region.numel * itemsize,
        )


def _check_compatible(old: Placement, new: Placement, tensors: Sequence[TensorMeta]) -> None:
    """Both placements describe the same model, and every tensor belongs to one of its units."""
    units = old.layout.num_units
    if new.layout.num_units != units:
        raise ReshardError(
            f"old layout {old.layout.describe()} covers {units} units but new layout "
            f"{new.layout.describe()} covers {new.layout.num_units}: both must partition the "
            f"same model"
        )
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise ReshardError(f"tensor {tensor.name!r} is listed twice: names must be unique")
        seen.add(tensor.name)
        if tensor.unit is not None and tensor.unit >= units:
            raise ReshardError(
                f"tensor {tensor.name!r} belongs to unit {tensor.unit} but the layouts cover "
                f"units 0..{units - 1}: build the tensor list from the same model as the layouts"
            )

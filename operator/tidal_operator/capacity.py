"""What the policy's steps share: free GPUs by node, the nodes a placement allows, a job's rows.

Bookkeeping only, no decision: :mod:`tidal_operator.policy` (restore, scale up) and
:mod:`tidal_operator.scale_down` take GPUs out of and put them back into one :class:`FreeGPUs`,
and read scale tables through :class:`Rows`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter

from tidal_api import ScaleTable
from tidal_operator.snapshot import Placement, Snapshot


def place(free: FreeGPUs, count: int, size: int, allowed: frozenset[str] | None) -> list[str]:
    """Nodes for up to ``count`` pods of ``size`` GPUs, one at a time by best fit, taken out of
    ``free``; fewer where they do not fit."""
    nodes = []
    for _ in range(count):
        node = free.tightest(size, allowed)
        if node is None:
            break
        free.add(node, -size)
        nodes.append(node)
    return nodes


def placed(nodes: list[str]) -> str:
    """The nodes as a decision's message names them: "node-0 x2, node-1"."""
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in Counter(nodes).items())


class Where:
    """The nodes each placement allows, once per distinct placement: None for all of them
    (no selector, and no node has a taint that keeps pods off)."""

    __slots__ = ("_nodes", "_open", "_seen")

    def __init__(self, snapshot: Snapshot) -> None:
        self._nodes = snapshot.nodes
        self._open = (not any(map(attrgetter("taints"), snapshot.nodes))
                      or all(node.open_to_all for node in snapshot.nodes))
        self._seen: dict[Placement, frozenset[str] | None] = {}

    def __call__(self, placement: Placement) -> frozenset[str] | None:
        if self._open and not placement.node_selector:
            return None
        if placement not in self._seen:
            self._seen[placement] = frozenset(
                n.name for n in self._nodes if placement.allows(n))
        return self._seen[placement]


class FreeGPUs:
    """Free GPUs per node; the nodes with any are bucketed by amount, names sorted, so that
    "how many workers fit" and "the tightest node that fits" cost O(distinct amounts). How
    many fit is kept per size until GPUs move: every job's offer asks it."""

    __slots__ = ("free", "idle", "_buckets", "_slots")

    def __init__(self, free: dict[str, int]) -> None:
        self.free = free
        self.idle = 0
        self._buckets: dict[int, list[str]] = {}
        self._slots: dict[tuple[int, frozenset[str] | None], int] = {}
        for name in sorted(name for name, gpus in free.items() if gpus > 0):
            self.idle += free[name]
            self._buckets.setdefault(free[name], []).append(name)

    def slots(self, size: int, allowed: frozenset[str] | None = None) -> int:
        """How many pods of ``size`` GPUs fit, each on one node (of ``allowed``, if given)."""
        count = self._slots.get((size, allowed))
        if count is None:
            count = self._slots[size, allowed] = sum(
                (len(names) if allowed is None else sum(n in allowed for n in names))
                * (amount // size)
                for amount, names in self._buckets.items() if amount >= size)
        return count

    def tightest(self, size: int, allowed: frozenset[str] | None = None) -> str | None:
        """The node with the fewest free GPUs that still fits ``size`` (best fit), among
        ``allowed`` if given."""
        amounts = [amount for amount in self._buckets if amount >= size]
        if allowed is None:
            return self._buckets[min(amounts)][0] if amounts else None
        for amount in sorted(amounts):
            for name in self._buckets[amount]:
                if name in allowed:
                    return name
        return None

    def add(self, node: str, gpus: int) -> None:
        self._slots.clear()
        old = self.free[node]
        new = self.free[node] = old + gpus
        self.idle += max(new, 0) - max(old, 0)
        if old > 0:
            bucket = self._buckets[old]
            del bucket[bisect_left(bucket, node)]
            if not bucket:
                del self._buckets[old]
        if new > 0:
            insort(self._buckets.setdefault(new, []), node)


@dataclass(slots=True)
class Rows:
    """A job's kept scale-table rows as parallel columns, to bisect by worker count."""

    workers: tuple[int, ...]
    tps: tuple[float, ...]
    step_s: tuple[float, ...]

    @classmethod
    def of(cls, table: ScaleTable) -> Rows:
        return cls(*table.columns)

    def at_most(self, workers: int) -> int:
        """Index of the largest row with at most ``workers`` (where the job runs), or -1."""
        return bisect_right(self.workers, workers) - 1

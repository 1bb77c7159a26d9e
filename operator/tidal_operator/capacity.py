"""What the policy's steps share: free GPUs by node, the nodes a placement allows, a job's rows.

Bookkeeping only, no decision: :mod:`tidal_operator.policy` (restore, scale up) and
:mod:`tidal_operator.scale_down` take GPUs out of and put them back into one :class:`FreeGPUs`,
and read scale tables through :class:`Rows`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
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
    counts = dict.fromkeys(nodes, 0)
    for node in nodes:
        counts[node] += 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


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
    """Free GPUs per node, the nodes with any bucketed by amount, so that "how many workers
    fit" and "the tightest node that fits" cost O(distinct amounts), and moving GPUs O(log
    nodes). Each bucket is a heap of node names, the least first; a node that has left its
    bucket stays in its heap until it comes up there (its free GPUs then differ), so a move
    is a push. How many fit is kept per size until GPUs move: every job's offer asks it."""

    __slots__ = ("free", "idle", "_heaps", "_count", "_amounts", "_slots")

    def __init__(self, free: dict[str, int]) -> None:
        self.free = free
        self._heaps: dict[int, list[str]] = {}
        for name, gpus in free.items():
            if gpus > 0:
                self._heaps.setdefault(gpus, []).append(name)
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._count = {amount: len(heap) for amount, heap in self._heaps.items()}
        self._amounts = sorted(self._heaps)  # those with a node, ascending
        self.idle = sum(amount * count for amount, count in self._count.items())
        self._slots: dict[tuple[int, frozenset[str] | None], int] = {}

    def slots(self, size: int, allowed: frozenset[str] | None = None) -> int:
        """How many pods of ``size`` GPUs fit, each on one node (of ``allowed``, if given)."""
        count = self._slots.get((size, allowed))
        if count is None:
            count = self._slots[size, allowed] = sum(
                (self._count[amount] if allowed is None
                 else len(self._nodes(amount) & allowed)) * (amount // size)
                for amount in self._amounts[bisect_left(self._amounts, size):])
        return count

    def tightest(self, size: int, allowed: frozenset[str] | None = None) -> str | None:
        """The node with the fewest free GPUs that still fits ``size`` (best fit), the first
        by name among equals, among ``allowed`` if given."""
        amounts = self._amounts
        start = bisect_left(amounts, size)
        if allowed is None:
            return self._first(amounts[start]) if start < len(amounts) else None
        for amount in amounts[start:]:
            fitting = self._nodes(amount) & allowed
            if fitting:
                return min(fitting)
        return None

    def _first(self, amount: int) -> str:
        """The least name of the nodes with ``amount`` free GPUs (there is one)."""
        heap, free = self._heaps[amount], self.free
        while free[heap[0]] != amount:
            heapq.heappop(heap)
        return heap[0]

    def _nodes(self, amount: int) -> set[str]:
        free = self.free
        return {name for name in self._heaps[amount] if free[name] == amount}

    def add(self, node: str, gpus: int) -> None:
        self._slots.clear()
        old = self.free[node]
        new = self.free[node] = old + gpus
        self.idle += max(new, 0) - max(old, 0)
        count = self._count
        if old > 0:
            count[old] -= 1
            if not count[old]:
                del count[old], self._amounts[bisect_left(self._amounts, old)]
                self._heaps[old] = []
        if new > 0:
            if new not in count:
                count[new] = 0
                insort(self._amounts, new)
            count[new] += 1
            heapq.heappush(self._heaps.setdefault(new, []), node)


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

"""Peer snapshots (DESIGN.md section 2, Faults): a lost worker costs only the step in flight.

At every step boundary each member of a world copies its training state (everything
``Trainer.state_tensors`` holds: parameters, AdamW moments and step; data, learning rate and
dropout are functions of the step) into one flat buffer, and sends that copy to the next
member of the world, its *keeper* (``members[(rank + 1) % size]``, the rule of
tidal_plan.keepers), while it receives the copy of the member before it, its *ward*. So every
member's state at that boundary lives on two workers, and losing one worker (or several, none
next to another in the ring) loses none of it.

A worker keeps its two newest own copies and its ward's two newest complete ones. Two, because
the members of a failed step may stand at different boundaries: one that finished the step
(its optimizer ran) is a boundary past a lost member that did not, whose newest copy is the
one before. A *cut* is one boundary of one world (generation, members, step); it is whole when
every member's copy at it survives, its own or its keeper's. The leader picks the newest whole
cut from the survivors' summaries (:func:`choose_cut`), and the survivors rebuild the state
of that step in their new layout with an ordinary reshard plan from the cut's placement, in
which a keeper sends for its lost ward (``senders``).

The price: four times the state's memory per worker (two own copies, two of the ward's) and one
state-sized transfer per worker per step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tidal_agent.world import World
from tidal_api.layout import Layout
from tidal_plan.reshard import Placement, TensorMeta

KEEP = 2  # copies of each kind: see the module docstring
_TAG = 7_000_001  # the exchange's P2P tag (nothing else is in flight at a boundary)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """One step boundary of one world: where the survivors' state is rebuilt from.

    ``senders`` maps each lost member of the cut's world to the survivor (its keeper) that
    holds its copy and sends it in the member's place.
    """

    generation: int
    members: tuple[str, ...]
    layout: Layout
    step: int
    senders: Mapping[str, str]

    @property
    def key(self) -> tuple[int, int, tuple[str, ...], Layout]:
        # The layout too: a re-plan's boundary has two cuts of one generation and step, the
        # same state in two layouts.
        return (self.generation, self.step, self.members, self.layout)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members),
                "layout": self.layout.to_dict(), "step": self.step,
                "senders": dict(self.senders)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cut:
        return cls(generation=data["generation"], members=tuple(data["members"]),
                   layout=Layout(**data["layout"]), step=data["step"],
                   senders=dict(data.get("senders", {})))


@dataclass(slots=True)
class _Copy:
    """A flat copy of one worker's state at one boundary; ``index``: name -> (offset, numel)."""

    cut: Cut  # senders empty: where the copy was taken
    owner: str
    flat: torch.Tensor
    index: dict[str, tuple[int, int]]

    def views(self) -> dict[str, torch.Tensor]:
        """The state by name, as 1-D views of the flat buffer."""
        return {name: self.flat[o:o + n] for name, (o, n) in self.index.items()}

    def summary(self) -> dict[str, Any]:
        return {**self.cut.to_json(), "of": self.owner}


class PeerSnapshots:
    """One worker's own copies and its ward's, taken at every step boundary (:meth:`take`)."""

    def __init__(self, metas: Sequence[TensorMeta], device: torch.device) -> None:
        self.metas = tuple(metas)
        self.device = device
        self.own: list[_Copy] = []  # oldest first
        self.ward: list[_Copy] = []
        self.seconds = 0.0  # the newest take's
        self._indexes: dict[tuple[Layout, tuple[str, ...], str], dict[str, tuple[int, int]]] = {}

    def take(self, world: World, generation: int, layout: Layout, step: int,
             state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (this worker's, ``step`` steps done) and swap copies with the
        neighbours in ``world``'s ring; every member calls it at the same boundary."""
        started = time.perf_counter()
        me = world.members[world.rank]
        cut = Cut(generation=generation, members=world.members, layout=layout, step=step,
                  senders={})
        index = self._index(layout, world.members, me)
        if set(index) != set(state):
            raise ValueError(f"{me} holds {sorted(set(state) ^ set(index))[:3]}... unlike its "
                             f"position in {layout.describe()}")
        own = self._slot(self.own, cut, me, index)
        for name, (offset, numel) in index.items():
            own.flat[offset:offset + numel].copy_(state[name].reshape(-1))
        self.own.append(own)
        if world.size > 1:
            ward_name = world.members[(world.rank - 1) % world.size]
            ward = self._slot(self.ward, cut, ward_name,
                              self._index(layout, world.members, ward_name))
            works = [world.send(own.flat, (world.rank + 1) % world.size, _TAG),
                     world.recv(ward.flat, (world.rank - 1) % world.size, _TAG)]
            for work in works:
                work.wait()
            self.ward.append(ward)  # only now complete
        self.seconds = time.perf_counter() - started

    def _index(self, layout: Layout, members: tuple[str, ...],
               worker: str) -> dict[str, tuple[int, int]]:
        """Where each tensor ``worker`` holds sits in its flat copy (once per generation)."""
        key = (layout, members, worker)
        if key not in self._indexes:
            self._indexes[key] = state_index(self.metas, Placement(layout=layout,
                                                                   workers=members), worker)
        return self._indexes[key]

    def _slot(self, copies: list[_Copy], cut: Cut, owner: str,
              index: dict[str, tuple[int, int]]) -> _Copy:
        """A buffer for a new copy: the oldest one's if it is the right size (it stops being a
        copy from now on), else a fresh one; the list keeps at most ``KEEP - 1`` others."""
        numel = sum(n for _, n in index.values())
        old = copies.pop(0) if len(copies) >= KEEP else None
        if old is not None and old.flat.numel() == numel:
            flat = old.flat
        else:
            flat = torch.empty(numel, dtype=torch.float32, device=self.device)
        return _Copy(cut=cut, owner=owner, flat=flat, index=index)

    def summary(self) -> dict[str, Any]:
        """What this worker holds, for the leader's :func:`choose_cut` (JSON)."""
        return {"own": [c.summary() for c in self.own], "ward": [c.summary() for c in self.ward]}

    def held(self, cut: Cut, me: str) -> tuple[dict[str, torch.Tensor] | None,
                                                 dict[str, dict[str, torch.Tensor]]]:
        """This worker's own state at ``cut`` (None if it was no member) and the states it
        sends for lost members, by member."""
        own = next((c.views() for c in self.own if c.cut.key == cut.key), None)
        if me in cut.members and own is None:
            raise RuntimeError(f"{me} holds no copy of step {cut.step} of generation "
                               f"{cut.generation}, yet the cut needs it")
        held = {}
        for lost, sender in cut.senders.items():
            if sender == me:
                copy = next((c for c in self.ward if c.cut.key == cut.key and c.owner == lost),
                            None)
                if copy is None:
                    raise RuntimeError(f"{me} holds no copy of {lost} at step {cut.step}")
                held[lost] = copy.views()
        return own, held

    def clear(self) -> None:
        self.own.clear()
        self.ward.clear()


def state_index(metas: Sequence[TensorMeta], placement: Placement,
                worker: str) -> dict[str, tuple[int, int]]:
    """The state tensors ``worker`` holds in ``placement``, in global order, as name ->
    (offset, numel) in one flat buffer."""
    index, offset = {}, 0
    for meta in metas:
        if meta.unit is None or worker in placement.holders(meta.unit):
            index[meta.name] = (offset, meta.numel)
            offset += meta.numel
    return index


def choose_cut(summaries: Mapping[str, Mapping[str, Any]]) -> Cut | None:
    """The newest whole cut the survivors hold, given each survivor's ``summary()``.

    A cut is whole when every member of its world is a survivor holding its own copy at it, or
    a lost member whose copy a survivor holds. Newest: the most steps done, then the newest
    generation (two cuts at one switch boundary hold the same state). None if there is none.
    """
    own: dict[tuple, set[str]] = {}
    kept: dict[tuple, dict[str, str]] = {}  # cut -> lost member -> keeper
    found: dict[tuple, Mapping[str, Any]] = {}
    for pod, summary in summaries.items():
        for copy in summary.get("own", ()):
            key = _key(copy)
            own.setdefault(key, set()).add(pod)
            found.setdefault(key, copy)
        for copy in summary.get("ward", ()):
            kept.setdefault(_key(copy), {}).setdefault(copy["of"], pod)
    for key in sorted(found, key=lambda k: (k[1], k[0]), reverse=True):
        generation, step, members, _ = key
        senders = {}
        for member in members:
            if member in summaries:
                if member not in own.get(key, ()):
                    break
            elif member in kept.get(key, {}):
                senders[member] = kept[key][member]
            else:
                break
        else:
            return Cut.from_json({**found[key], "senders": senders})
    return None


def _key(copy: Mapping[str, Any]) -> tuple[int, int, tuple[str, ...], Layout]:
    return (copy["generation"], copy["step"], tuple(copy["members"]), Layout(**copy["layout"]))

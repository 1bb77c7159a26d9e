"""What a worker asks the source of its generations, and the answers it gets.

A worker trains in a sequence of generations (membership and layout) and learns of each from a
``GenerationSource``: a schedule known in advance (``StaticGenerations``, ``tidal run``) or the
operator's targets, agreed on through the rendezvous store at run time
(``tidal_agent.generations.ControlledGenerations``, ``tidal agent``). The training loop
(tidal_agent.worker) is the same for both.

At a step boundary the source answers with the next generation, or with ``Halt`` when the job
stops there (its leader was asked to stop). On the fault path it answers with a ``Recovery``:
where the survivors go on; ``RendezvousLost`` says that the job cannot, because the rendezvous
store is gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal_agent.snapshot import Cut
from tidal_api.layout import Layout
from tidal_plan.elastic import Generation


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """Where the survivors of a failed generation go on: agreed on by all of them."""

    generation: Generation  # the survivors; at_step is the step training resumes at
    world: str  # the name of its world: a fresh one for every recovery
    checkpoint: str | None  # the checkpoint to load (saved at at_step)
    failed_at: int  # the step (or switch boundary) the leader was at when it failed
    lost: tuple[str, ...]  # the members that did not survive
    snapshot: Cut | None = None  # the peer snapshots to rebuild from (at at_step)
    left: tuple[str, ...] = ()  # of the lost, those that left when asked to stop (SIGTERM)
    # neither checkpoint nor snapshot: start afresh from step 0


class LeaderRecovering(RuntimeError):
    """The leader took the fault path, or is lost: a member waiting at a step boundary takes
    the fault path too."""


def gen_json(gen: Generation, layout: Layout) -> dict[str, Any]:
    """A generation and its layout as the rendezvous store keeps them."""
    return {"index": gen.index, "revision": gen.revision, "at_step": gen.at_step,
            "members": list(gen.members), "layout": layout.to_dict()}


def gen_from(data: Mapping[str, Any]) -> tuple[Generation, Layout]:
    """:func:`gen_json`'s record read back."""
    gen = Generation(index=data["index"], at_step=data["at_step"],
                     members=tuple(data["members"]), revision=data.get("revision", 0))
    return gen, Layout(**data["layout"])


class RendezvousLost(RuntimeError):
    """The rendezvous store is gone (its pod lost): the job cannot go on."""


@dataclass(frozen=True, slots=True)
class Halt:
    """The job stops at the boundary before ``step``: its leader was asked to stop. Every
    member saves a checkpoint of that boundary (where the job has a checkpoint path), for the
    restart to start from, and leaves."""

    step: int


class GenerationSource(Protocol):
    """Where a worker learns which generation it belongs to, and when the next one starts.

    Every member of a generation calls ``following`` at each step boundary until it returns
    the next generation, with the same ``step`` on every member, so all of them learn of it at
    the same boundary and switch at its ``at_step`` (that boundary, or a later one).
    """

    @property
    def leader(self) -> str:
        """The leader now: rank 0 of its generation's worlds; it reports steps and switches."""

    def start(self, me: str) -> tuple[Generation, Generation | None] | None:
        """The generation ``me`` first trains in and the one before it (None for the first
        generation); None if ``me`` is let go without ever training."""

    @property
    def resume_from(self) -> str | None:
        """The checkpoint the first generation loads, once ``start`` has returned it (None:
        it starts from the seed at its ``at_step``)."""

    def layout(self, gen: Generation) -> Layout:
        """The layout of a generation this worker has heard of."""

    def following(self, gen: Generation, step: int) -> Generation | Halt | None:
        """At the boundary before ``step``: the generation after ``gen`` if it is known, or
        ``Halt`` if the job stops there."""

    @property
    def replans(self) -> bool:
        """Whether ``replan`` may be called: the source can number a generation of its own."""

    def replan(self, gen: Generation, layout: Layout, *, at_step: int) -> Generation:
        """The generation after ``gen``: the same members in ``layout`` (the straggler watch
        re-planned, every member at the same boundary), from ``at_step``."""

    @property
    def drops(self) -> bool:
        """Whether a straggler may be handed back (the operator releases it on request)."""

    def recover(self, me: str, trained: Generation, step: int, error: Exception,
                held: dict[str, Any] | None = None) -> Recovery | None:
        """``me`` failed at ``step`` in generation ``trained`` with ``error``, holding the peer
        snapshots ``held`` describes (``PeerSnapshots.summary``): where the survivors go on
        (None if ``me`` is not one of them). Raises ``error`` when training cannot go on:
        nothing to recover with, or no member was lost (a bug, not a fault)."""

    def gone(self, members: tuple[str, ...]) -> set[str]:
        """Those of ``members`` known dead (their connection to the rendezvous ended): a
        world being built with them is not waited for."""

    def depart(self, me: str, step: int) -> None:
        """``me``, asked to stop, leaves at the boundary before ``step`` unasked by any
        target: the others lose it and go on without waiting for its silence."""

    def rescue(self, me: str, trained: Generation,
               held: dict[str, Any] | None) -> tuple[Generation, Cut, Any] | None:
        """The rendezvous is lost (``recover`` raised ``RendezvousLost``): the generation whose
        world the members of ``trained`` save the newest boundary their peer snapshots hold
        whole in (``held``: this one's ``PeerSnapshots.summary``), that cut, and a store to
        build the world on; None if they cannot."""


@dataclass(frozen=True, slots=True)
class StaticGenerations:
    """A membership schedule known in advance: every generation and its layout, and, where
    the schedule is one generation, the re-plans the straggler watch adds to it."""

    generations: tuple[Generation, ...]
    layouts: tuple[Layout, ...]  # one per generation
    resume_from: str | None = None  # a checkpoint directory (tidal run --resume)
    # Re-plans by generation index (after the schedule's own, which they never interleave).
    added: dict[int, tuple[Generation, Layout]] = field(default_factory=dict)

    @property
    def leader(self) -> str:
        return self.generations[0].members[0]

    def start(self, me: str) -> tuple[Generation, Generation | None]:
        gen = next(g for g in self.generations if me in g.members)
        return gen, self.generations[gen.index - 1] if gen.index else None

    def layout(self, gen: Generation) -> Layout:
        if gen.index in self.added:
            return self.added[gen.index][1]
        return self.layouts[gen.index]

    def following(self, gen: Generation, step: int) -> Generation | None:
        nxt = gen.index + 1
        if nxt in self.added:
            return self.added[nxt][0]
        return self.generations[nxt] if nxt < len(self.generations) else None

    @property
    def replans(self) -> bool:
        # A joiner of a later scheduled generation would not know of the re-plans before it.
        return len(self.generations) == 1

    @property
    def drops(self) -> bool:
        return False  # the schedule is fixed up front

    def replan(self, gen: Generation, layout: Layout, *, at_step: int) -> Generation:
        following = Generation(index=gen.index + 1, at_step=at_step, members=gen.members)
        self.added[following.index] = (following, layout)
        return following

    def recover(self, me: str, trained: Generation, step: int, error: Exception,
                held: dict[str, Any] | None = None) -> Recovery | None:
        raise error  # the launcher names the lost worker; --resume goes on without it

    def gone(self, members: tuple[str, ...]) -> set[str]:
        return set()  # the launcher watches its workers' processes itself

    def depart(self, me: str, step: int) -> None:
        raise RuntimeError(f"{me}: a static schedule has no departures (tidal run stops "
                           "its workers itself)")

    def rescue(self, me: str, trained: Generation,
               held: dict[str, Any] | None) -> tuple[Generation, Cut, Any] | None:
        return None  # the launcher hosts the store and stops every worker

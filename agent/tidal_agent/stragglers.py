"""The straggler watch: every member times its decoder layers, the leader judges and re-plans.

At each step boundary every member of a world posts its seconds per decoder-layer forward of
the step just trained (``Trainer.layer_seconds``) to the rendezvous store. The leader reads the
posts of the step before (all made a step ago, since every member took part in the step since:
it never waits), feeds them to a ``tidal_plan.stragglers.StragglerDetector`` and reports each
flag raised or cleared (``Straggler``). With ``spec.stragglers.replan`` and a source that takes
re-plans, a change of flags makes the leader price a partition for the stragglers' measured
speeds (the others count as equally fast); one that gains at least ``minGain`` is written for
the next boundary, where every member reads it (the leader wrote it a step before, so nobody
waits) and the source announces a generation of the same members in that layout, switched to
live one step later. In strict mode the re-planned run keeps the bits of one process, as any
switch does. The same channel carries the leader's request to profile again (the step time
drifted from the profiled prediction: ``tidal_plan.predictors.Drift``).

From a straggler's onset to the switch: ``steps`` slow steps to flag it, one step for the
posts to reach the leader, one for the decision to reach everyone, one to build the world.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tidal_agent.events import EventSink, Replanned, Straggler
from tidal_agent.trainer import Trainer
from tidal_api.layout import Layout
from tidal_api.spec import StragglerSpec
from tidal_plan.elastic import share_unit
from tidal_plan.stragglers import (StragglerDetector, drop_beats_keeping, pipeline_rank_speeds,
                                   replan_layout)

log = logging.getLogger("tidal.agent")


@dataclass(frozen=True, slots=True)
class Word:
    """What the leader wrote for a boundary: a re-plan, and whether to profile again."""

    layout: Layout | None
    profile: bool


class StragglerWatch:
    """One member's part in one world; the leader's detector lives on across worlds."""

    def __init__(self, spec: StragglerSpec, *, me: str, leader: bool, trainer: Trainer,
                 start: int, detector: StragglerDetector, unit_seconds: Sequence[float],
                 replans: bool, drops: bool, events: EventSink) -> None:
        self.spec, self.me, self.leader = spec, me, leader
        self.trainer, self.start = trainer, start  # the world's first step
        self.detector, self.events = detector, events
        self.unit_seconds = tuple(unit_seconds)
        self.replans = replans and spec.replan and len(self.unit_seconds) > 0
        self.drops = drops and self.replans  # an operator to hand a straggler back to
        world = trainer.world
        self.store, self.members = world.store, world.members
        self._key = f"stragglers/{world.name}/{world.generation}"
        self._pending = False  # a re-plan written, not yet switched to
        self._profile = False  # the leader asks every member to profile again
        self.seconds = 0.0  # the newest boundary's own time (its cost, measured)

    def ask_profile(self) -> None:
        """The leader's: every member profiles again, from the boundary after next (the step
        time drifted from the profiled prediction)."""
        self._profile = True

    def boundary(self, step: int) -> Word | None:
        """At the boundary before ``step``: post this member's time of ``step - 1``; the
        leader judges ``step - 2`` and may write a re-plan, or a request to profile again,
        for ``step + 1``. Returns what every member reads here (a re-plan is announced for
        ``step + 1``), or None."""
        started = time.perf_counter()
        try:
            return self._boundary(step)
        finally:
            self.seconds = time.perf_counter() - started

    def speeds(self) -> dict[str, float]:
        """The leader's view: each member's speed relative to the fastest ({} elsewhere)."""
        if not self.leader:
            return {}
        return {m: self.detector.speed(m) for m in self.members}

    def _boundary(self, step: int) -> Word | None:
        key, store = self._key, self.store
        if step > self.start:
            seconds = self.trainer.layer_seconds()
            store.set(f"{key}/t/{step - 1}/{self.me}", json.dumps(seconds))
        if self.leader:
            decided = self._judge(step - 2) if step - 2 >= self.start else None
            word = None
            if decided is not None or self._profile:
                word = {"layout": decided and decided.to_dict(), "profile": self._profile}
                self._profile = False
            store.set(f"{key}/plan/{step + 1}", json.dumps(word))
        if step <= self.start:
            return None
        raw = store.get(f"{key}/plan/{step}")
        if self.leader:
            store.delete_key(f"{key}/plan/{step - 1}")  # every member read it a step ago
        word = json.loads(raw)
        if word is None:
            return None
        return Word(layout=Layout(**word["layout"]) if word["layout"] else None,
                    profile=word["profile"])

    def _judge(self, step: int) -> Layout | None:
        """The leader's part: flags from ``step``'s posts, and a re-plan if they changed."""
        keys = [f"{self._key}/t/{step}/{m}" for m in self.members]
        times = dict(zip(self.members, (json.loads(v) for v in self.store.multi_get(keys)),
                         strict=True))
        for k in keys:
            self.store.delete_key(k)
        changes = self.detector.observe(step, times)
        for change in changes:
            verb = "is a straggler" if change.flagged else "is no longer a straggler"
            release = change.flagged and self._better_without(change.member)
            log.warning("step %d: %s %s (%.2fx the others' layer time)%s", step, change.member,
                        verb, change.slowdown, "; asking to release it" if release else "")
            self.events.put(Straggler(worker=self.me, member=change.member, step=step,
                                      flagged=change.flagged, slowdown=change.slowdown,
                                      release=release))
        if not changes or not self.replans or self._pending:
            return None
        return self._replan(step)

    def _planned_speeds(self) -> list[float]:
        """Each member's speed in world-rank order: the stragglers' measured, the others' 1."""
        # Only stragglers are planned around: a difference under the factor is the load's
        # pattern as much as the rank's (a rank that waits more finds its caches colder).
        flagged = self.detector.flagged
        return [self.detector.speed(m) if m in flagged else 1.0 for m in self.members]

    def _better_without(self, member: str) -> bool:
        """Whether the operator should release ``member``: it is not the leader (which hosts
        the rendezvous) and a pipeline without it is predicted faster by minGain than the
        current ranks re-planned for their speeds (dp 1)."""
        layout = self.trainer.layout
        if not self.drops or member == self.members[0] or layout.dp != 1:
            return False
        rank_speeds = pipeline_rank_speeds(layout, self._planned_speeds())
        return drop_beats_keeping(layout, self.unit_seconds, rank_speeds,
                                  self.members.index(member), self.spec.min_gain)

    def _replan(self, step: int) -> Layout | None:
        layout, spec = self.trainer.layout, self.trainer.spec
        planned = self._planned_speeds()
        layers = range(1, spec.model.layers + 1)
        plan = replan_layout(layout, self.unit_seconds, planned, layers, share_unit(spec, layout))
        speeds = dict(zip(self.members, planned, strict=True))
        new = plan.layout
        if new == layout or plan.gain < self.spec.min_gain:
            return None
        log.warning("step %d: re-planning %s -> %s for speeds %s (predicted %+.0f%%)", step,
                    layout.describe(), new.describe(),
                    ", ".join(f"{m} {s:.2f}" for m, s in speeds.items()), plan.gain * 100)
        self.events.put(Replanned(worker=self.me, step=step, at_step=step + 4,
                                  from_layout=layout, to_layout=new, speeds=speeds,
                                  gain=plan.gain))
        self._pending = True
        return new

"""The leader's account of a job: the worker's events as status, metrics and a JSON report.

``AgentReport`` reads the worker's events (tidal_agent.events) and the generation source's
word on what it planned and applied. On the leader it publishes the job's progress in
``status`` (through its ``ControlLink``) and in Prometheus metrics (tidal_agent.metrics), and
keeps the run's report: per-step losses, generations, switches and recoveries. The leader
also keeps that history in the rendezvous store (its journal), where the pod that takes the
lead from a lost leader finds it (``lead``).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tidal_agent.events import (Finished, Halted, Left, Listener, Profiled, Ready, Reconfigured,
                                Recovered, Replanned, Stepped, Straggler)
from tidal_agent.link import ControlLink
from tidal_agent.metrics import JobMetrics
from tidal_api.layout import Layout
from tidal_plan.elastic import Generation

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("tidal.agent")

# The report's lists a leader hands on to the next, as the journal keeps them.
JOURNALED = ("generations", "reconfigurations", "recoveries", "stragglers", "replans", "profiled")
READ_AT_ONCE = 1000  # journal records per store round trip, as a new leader reads them


def _read(journal: dist.Store, keys: list[str]) -> list[Any]:
    """The records under ``keys``, in order, a few round trips for however many there are
    (one per key would hold a new leader's fault path up for seconds in a long job)."""
    records = []
    for at in range(0, len(keys), READ_AT_ONCE):
        records += [json.loads(v) for v in journal.multi_get(keys[at:at + READ_AT_ONCE])]
    return records


class AgentReport(Listener):
    """The worker's events (``put``) as status fields and metrics on the leader, and as a
    JSON report.

    Every pod has one; only the leader's has a link and metrics, and sees step and switch
    events.
    """

    def __init__(self, link: ControlLink | None, *, tokens_per_step: int, window: int = 10,
                 metrics: JobMetrics | None = None, final_step: int | None = None):
        self.link, self.tokens_per_step, self.metrics = link, tokens_per_step, metrics
        # status.step at the job's last step says the job is done (the operator marks it
        # Succeeded): not published with that step but by the leader's end, once its report
        # is written.
        self.final_step = final_step
        # The leader's: the store its history goes to (``lead``), one record per key:
        # ``journal/step/<step>`` (from ``journal/step/first`` to before ``journal/step/next``),
        # ``journal/<list>/<n>`` (from 1 to ``journal/<list>/count``).
        self.journal: dist.Store | None = None
        self._first_kept = False  # journal/step/first is set
        self.steps: list[dict[str, Any]] = []
        self.reconfigurations: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.generations: list[dict[str, Any]] = []
        self.digests: dict[int, tuple[str, str]] | None = None
        self.num_params = 0  # the whole model's, from the Finished event
        self.left_at: int | None = None
        self.halted: Halted | None = None  # where the job halted, and its checkpoint
        self.setup: dict[str, Any] = {}  # where it trains: device, backend, transport, determinism
        self._recent: deque[float] = deque(maxlen=window)
        self._predicted: dict[int, float | None] = {}
        self.stragglers: list[dict[str, Any]] = []  # every flag raised or cleared
        self.replans: list[dict[str, Any]] = []
        self._flagged: dict[str, Straggler] = {}  # flagged now
        # per online profile: layout, steps [first, last), the profiled prediction
        self.profiled: list[dict[str, Any]] = []
        # Called with each profile on the leader (off the training thread, one profile after
        # the other): the profiled prediction of its layout, or None; the scale table goes out
        # from there too.
        self.on_profile: Callable[[Profiled], float | None] | None = None
        self._profiling: ThreadPoolExecutor | None = None

    def lead(self, link: ControlLink, journal: dist.Store | None = None) -> None:
        """This pod leads from now on: its events go to ``link`` and to ``journal``, after
        the history the leaders before it kept there."""
        if journal is not None:
            self._first_kept = journal.check(["journal/step/first"])
            if self._first_kept:
                first, end = (int(journal.get(f"journal/step/{k}")) for k in ("first", "next"))
                self.steps = _read(journal, [f"journal/step/{s}" for s in range(first, end)])
            for name in JOURNALED:
                count = journal.add(f"journal/{name}/count", 0)
                setattr(self, name, _read(journal, [f"journal/{name}/{n}"
                                                    for n in range(1, count + 1)]))
            for record in self.stragglers:  # who is flagged now, as the history says
                if record["flagged"]:
                    self._flagged[record["member"]] = Straggler(worker="", **record)
                else:
                    self._flagged.pop(record["member"], None)
        self.link, self.journal = link, journal

    def _keep(self, name: str, record: dict[str, Any]) -> None:
        """Append ``record`` to the list ``name``, in the journal too."""
        getattr(self, name).append(record)
        if self.journal is not None:
            n = self.journal.add(f"journal/{name}/count", 1)
            self.journal.set(f"journal/{name}/{n}", json.dumps(record))

    def on_ready(self, event: Ready) -> None:
        self.setup = event.record()

    def on_stepped(self, event: Stepped) -> None:
        record = event.record()
        self.steps.append(record)
        if self.journal is not None:
            if not self._first_kept:
                self.journal.compare_set("journal/step/first", "", str(event.step))
                self._first_kept = True
            self.journal.set(f"journal/step/{event.step}", json.dumps(record))
            self.journal.set("journal/step/next", str(event.step + 1))
        self._recent.append(event.seconds)
        log.info("step %5d  pp%d  loss %.4f  %7.1f ms", event.step, event.layout.pp, event.loss,
                 event.seconds * 1e3)
        seconds = statistics.median(self._recent)
        if self.metrics is not None:
            self.metrics.stepped(event.step, event.loss, event.seconds,
                                 self.tokens_per_step / seconds)
            self.metrics.speeds(event.speeds, len(self._flagged))
        if self.link is not None:
            done = event.step + 1
            progress = {"step": done} if done != self.final_step else {}
            self.link.publish(**progress, loss=event.loss, step_seconds=seconds,
                              tokens_per_second=self.tokens_per_step / seconds)

    def on_reconfigured(self, event: Reconfigured) -> None:
        self._keep("reconfigurations", event.record())
        if self.metrics is not None:
            self.metrics.switched(*event.workers, event.pause_s, event.bytes_moved)
        gen = Generation(index=event.generation, at_step=event.at_step, members=event.members)
        self.applied(gen, event.to_layout, switch_s=event.pause_s)
        self._forget_stragglers(event.members)

    def on_straggler(self, event: Straggler) -> None:
        self._keep("stragglers", event.record())
        if event.flagged:
            self._flagged[event.member] = event
        else:
            self._flagged.pop(event.member, None)
        if self.link is not None:
            self._publish_stragglers()
            verb = "is a straggler" if event.flagged else "is no longer a straggler"
            ask = ("; the job is predicted faster without it: asking the operator to release it"
                   if event.release else "")
            self.link.event(
                "Straggler" if event.flagged else "StragglerRecovered",
                f"step {event.step}: {event.member} {verb}: its decoder layers take "
                f"{event.slowdown:.2f}x the other workers' median{ask}", warning=event.flagged)

    def _publish_stragglers(self) -> None:
        self.link.publish(stragglers=[
            {"member": f.member, "slowdown": f.slowdown, "since_step": f.step,
             "release": f.release} for f in self._flagged.values()])

    def _forget_stragglers(self, members: tuple[str, ...]) -> None:
        """Flags of members that left (released, lost) are nobody's business any more."""
        gone = [m for m in self._flagged if m not in members]
        for member in gone:
            del self._flagged[member]
        if gone and self.link is not None:
            self._publish_stragglers()

    def on_replanned(self, event: Replanned) -> None:
        self._keep("replans", event.record())
        if self.link is not None:
            speeds = ", ".join(f"{m} {s:.2f}" for m, s in event.speeds.items())
            self.link.event("Replanned", f"step {event.step}: re-partitioned "
                            f"{event.from_layout.describe()} -> {event.to_layout.describe()} "
                            f"from step {event.at_step} for the workers' speeds ({speeds}); "
                            f"predicted {event.gain:+.0%}")

    def on_recovered(self, event: Recovered) -> None:
        """The survivors of a fault go on from ``resumed_at``: the steps from there on are
        replayed, and their results replace the ones reported before the fault."""
        resumed = event.resumed_at
        replayed = sum(1 for s in self.steps if s["step"] >= resumed)
        if self.journal is not None:  # a later leader reads from the first to the next
            for record in self.steps:
                if record["step"] >= resumed:
                    self.journal.delete_key(f"journal/step/{record['step']}")
            if self._first_kept:
                self.journal.set("journal/step/next", str(resumed))
        self.steps = [s for s in self.steps if s["step"] < resumed]
        self._keep("recoveries", {**event.record(), "replayed_steps": replayed})
        if self.metrics is not None:
            self.metrics.recovered(len(event.lost), replayed)
        if self.link is not None:  # goes out with the survivors' generation, below
            self.link.publish(step=resumed, lost=tuple(dict.fromkeys(
                p for r in self.recoveries for p in r["lost"])))
        gen = Generation(index=event.generation, at_step=resumed, members=event.members)
        self.applied(gen, event.layout, switch_s=event.pause_s)
        self._forget_stragglers(event.members)

    def on_profiled(self, event: Profiled) -> None:
        if self.on_profile is None:
            return
        if self._profiling is None:  # one thread: a slow plan is not overtaken by the next
            self._profiling = ThreadPoolExecutor(1, thread_name_prefix="tidal-profile")
        self._profiling.submit(self._profiled, event).add_done_callback(_log_failure)

    def settle(self) -> None:
        """Wait until every profile handed in is kept and its prediction published: at the
        job's end, so that the report and the final status say the same."""
        if self._profiling is not None:
            self._profiling.shutdown(wait=True)
            self._profiling = None

    def _profiled(self, event: Profiled) -> None:
        predicted = self.on_profile(event)
        if predicted is None:
            return
        self._keep("profiled", {"layout": event.layout.to_dict(), "steps": list(event.steps),
                              "predicted_s": predicted})
        log.info("profiled steps %d-%d of %s: predicted %.1f ms/step", event.steps[0],
                 event.steps[1] - 1, event.layout.describe(), predicted * 1e3)
        if self.metrics is not None:
            self.metrics.predicted_step_seconds.set(predicted)
        if self.link is not None:
            self.link.publish(predicted_step_seconds=predicted)

    def on_finished(self, event: Finished) -> None:
        self.digests, self.num_params = event.digests, event.num_params

    def on_left(self, event: Left) -> None:
        self.left_at = event.step

    def on_halted(self, event: Halted) -> None:
        self.halted = event

    def planned(self, index: int, predicted_step_s: float | None) -> None:
        """The planner's step seconds for generation ``index``'s layout (None: no prediction)."""
        self._predicted[index] = predicted_step_s

    def applied(self, gen: Generation, layout: Layout, switch_s: float | None = None) -> None:
        """Generation ``gen`` runs now (the leader's view)."""
        self._keep("generations", {"generation": gen.index, "at_step": gen.at_step,
                                 "members": list(gen.members), "layout": layout.to_dict(),
                                 "switch_s": switch_s})
        self._recent.clear()  # step times of another layout
        if self.metrics is not None:
            self.metrics.applied(gen.index, len(gen.members), layout.dp, layout.pp,
                                 self._predicted.get(gen.index))
        if self.link is None:
            return
        fields: dict[str, Any] = {
            "generation": gen.index, "members": gen.members, "layout": layout,
            "predicted_step_seconds": self._predicted.get(gen.index),
        }
        if switch_s is not None:
            fields["last_switch_seconds"] = switch_s
        self.link.publish(**fields)

    def acknowledged(self, generation: int) -> None:
        """A target that changes nothing, applied as it is."""
        if self.link is not None:
            self.link.publish(generation=generation)


def _log_failure(future: Future) -> None:
    if (err := future.exception()) is not None:
        log.error("a profile's prediction failed", exc_info=err)

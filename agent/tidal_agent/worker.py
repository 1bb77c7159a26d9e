"""A worker process: trains its share of each generation it belongs to, and switches live.

Its generations come from a ``GenerationSource`` (tidal_agent.protocol): a schedule known in
advance (``tidal run``) or the operator's targets (tidal_agent.generations, ``tidal agent``); the
training loop is the same for both. Its events (tidal_agent.events) go to the launcher's queue
or the leader's report: per-step results and reconfiguration timings from the leader
(``worker-0``, rank 0 of every world), checkpoint paths, parameter digests from every final
member, ``Released`` (how long after its last step it was free to go) and ``Left`` from a worker
released by a shrink, and ``Failed`` from a worker that fails.

A switch to generation g+1 happens between two steps, at the same step on every member. The
world of g+1 is built in a background thread while generation g trains; joiners wait in it
(standby) until the old members arrive. State moves over the larger of the two worlds (the new
one when growing, the old one when shrinking), then leavers exit and the others go on. A source
may announce a shrink for the boundary it is announced at (the operator's does: a pending pod
waits for the leavers' GPUs); its smaller world is then built during the pause, while the
leavers hand their state over. With peer snapshots, a shrink whose leavers' keepers all stay
(tidal_plan.keepers) lets the leavers go at the boundary, their state sent by their keepers
from the copies they hold (as on the fault path).

The fault path: when a step or a switch fails (a member died: its sockets closed, or a peer's
did), the worker closes every world it holds, so members still blocked on it fail too, and asks
its source to ``recover``. A schedule known in advance cannot (``tidal run`` stops and names the
lost worker; ``--resume`` continues); the operator's source agrees with the other survivors on a
generation without the lost members. With peer snapshots (``WorkerOptions.peer_snapshots``:
every member copies its state at each step boundary and its ring neighbour keeps a copy too,
``tidal_agent.snapshot``) the survivors rebuild the state of the newest boundary they hold
whole and replay only the step in flight (tidal_agent.recovery); else they resume from the
job's last complete checkpoint (from step 0 without one) and replay the steps since; bit for
bit in strict mode.

A leader lost unasked is lost like any member: a survivor takes the lead on the fault path
(tidal_agent.generations). Asked to stop (SIGTERM), the leader halts the job at its next step
boundary instead (``Halt``): every member saves a checkpoint of that boundary and exits, and
the operator restarts the job, whose first generation starts from the newest complete
checkpoint (``GenerationSource.resume_from``). The rendezvous lost takes the store with it
(``RendezvousLost``): the members save what their peer snapshots hold instead (``rescue``), so
the restart loses no more than the step in flight.

The module stays whole (past 400 lines): training, switching, halting and recovering are one
state machine over one trainer, world and step, which every path hands on to the next; the
state moves of the fault path (tidal_agent.recovery), the switch's data path
(tidal_agent.switch) and the snapshots (tidal_agent.snapshot) live apart.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import statistics
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from tidal_agent import compiled
from tidal_agent import checkpoint
from tidal_agent.calibrate import calibrate_trainer, time_collectives
from tidal_agent.devices import WorkerDevice, prepare_worker
from tidal_agent.events import (Checkpointed, EventSink, Failed, Finished, Halted, Left,
                                Profiled, Ready, Reconfigured, Recovered, Released, Stepped,
                                peak_rss_bytes)
from tidal_agent.measure import Clock, MemoryPeaks, TensorMemory
from tidal_agent.profiler import UnitProfiler, build_profile
from tidal_agent.protocol import (GenerationSource, Halt, Recovery, RendezvousLost,
                                  StaticGenerations)
from tidal_agent.recovery import rebuild, save_cut
from tidal_agent.snapshot import Cut, PeerSnapshots, state_index
from tidal_agent.stragglers import StragglerWatch
from tidal_agent.switch import TransferStats, carry_over, execute_reshard, state_metadata
from tidal_agent.trainer import Trainer, prepare_subgroups, warm_up_compiled
from tidal_agent.worker_options import WorkerOptions, profile_path, profile_window
from tidal_agent.world import World, WorldBuilder, abort_worlds, build_world
from tidal_api import JobSpec, keys
from tidal_plan.elastic import Generation
from tidal_plan.keepers import keepers, keepers_stay
from tidal_plan.predictors import Drift, ProfiledPredictor
from tidal_plan.profiled import Profile, ProfileError
from tidal_plan.reshard import Placement, ReshardPlan, plan_reshard
from tidal_plan.stragglers import StragglerDetector

log = logging.getLogger("tidal.agent")


def worker_main(me: str, spec_json: str, opts: WorkerOptions, events: EventSink) -> None:
    """Process entry point (spawned) for a static schedule; never raises, reports through
    ``events``."""
    try:
        spec = JobSpec.model_validate_json(spec_json)
        device = prepare_worker(opts.rendezvous.transport, opts.gpu, threads=opts.threads,
                                strict=spec.parallelism.consistency == "strict")
        source = StaticGenerations(opts.generations, opts.layouts, opts.resume_from)
        train(me, spec, opts, events, source, device)
    except BaseException as err:  # noqa: BLE001 - the launcher needs every failure, with cause
        events.put(Failed(worker=me, error=f"{type(err).__name__}: {err}",
                          traceback=traceback.format_exc()))
        raise SystemExit(1) from None


def train(me: str, spec: JobSpec, opts: WorkerOptions, events: EventSink,
          source: GenerationSource, device: WorkerDevice) -> None:
    """Train as worker ``me`` on ``device`` (tidal_agent.devices.prepare_worker's, made where
    the process starts) through the generations ``source`` gives, reporting to ``events``
    until step ``opts.steps`` or until ``me`` is released."""
    _Worker(me, spec, opts, events, source, device).run()


class _Worker:
    def __init__(self, me: str, spec: JobSpec, opts: WorkerOptions, events: EventSink,
                 source: GenerationSource, device: WorkerDevice) -> None:
        self.me, self.spec, self.opts, self.events = me, spec, opts, events
        self.source = source
        self.where, self.device = device, device.device
        self.peaks = MemoryPeaks(self.device)  # GPU memory: the run's, the switch's, the profile's
        self.tensors = (TensorMemory() if opts.track_memory and self.device.type == "cpu"
                        else None)
        self._tensor_peak = 0  # the steps' peak of self.tensors
        self.metas = state_metadata(spec.model)
        self.state_names = [meta.name for meta in self.metas]  # a checkpoint's, in order
        self.snapshots = (PeerSnapshots(self.metas, self.device, every=opts.snapshot_every)
                          if opts.peer_snapshots else None)
        self._held_s: float | None = None  # this boundary's snapshot's hold on training
        self._swapping = False  # a snapshot swap was under way at the newest failure
        self._last_step_end: float | None = None
        self._gen: Generation | None = None  # where training is: for the fault path
        self._step = 0
        self._stragglers = StragglerDetector(factor=spec.stragglers.factor,
                                             steps=spec.stragglers.steps)
        self._window = (0, 0)  # the steps [first, last) this generation profiles
        self._profiles = 0  # written so far (the leader's)
        self._drift = Drift()  # the leader's: measured step times against the profile's

    @property
    def leader(self) -> bool:
        return self.me == self.source.leader

    def _memory(self) -> dict:
        """What this worker's memory peaked at so far: its process's, its GPU's (None on a CPU)
        and its peer snapshots' host memory (None without them), for its last event."""
        return {"peak_rss_bytes": peak_rss_bytes(), "peak_gpu_bytes": self.peaks.run(),
                "snapshot_bytes": self.snapshots.peak_bytes if self.snapshots else None,
                "peak_tensor_bytes": self._tensor_peak if self.tensors else None}

    @property
    def _stopping(self) -> bool:
        return self.opts.stop is not None and self.opts.stop.is_set()

    def _trainer(self, gen: Generation, world: World, *, initialise: bool,
                 kept: dict[str, torch.Tensor] | None = None) -> Trainer:
        trainer = Trainer(spec=self.spec, layout=self.source.layout(gen), world=world,
                          device=self.device, clip_mode=self.opts.clip_mode,
                          initialise=initialise, kept=kept)
        return trainer

    def run(self) -> None:
        with self.tensors or contextlib.nullcontext():  # from before the first tensor
            self._run()

    def _run(self) -> None:
        # What the process imported and built before training is never garbage: frozen, it
        # is left out of every collection, and the fault path's takes milliseconds.
        gc.freeze()
        started = self.source.start(self.me)
        if started is None:  # let go from standby before any generation needed it
            self.events.put(Left(worker=self.me, step=None, **self._memory()))
            return
        enter: Callable[[], tuple[Trainer, World, int]] = partial(self._enter, *started)
        while True:
            try:
                self._train(enter)
                return
            except Exception as err:  # noqa: BLE001 - the source tells a fault from a bug
                if self._stopping:
                    log.warning("%s: failed while asked to stop (%s); not recovering", self.me,
                                err)
                    raise SystemExit(keys.STOPPED_EXIT_CODE) from None
                failed = time.perf_counter()
                try:
                    recovery = self._recover(err)
                except RendezvousLost:
                    self._rescue()
                    raise
            if recovery is None:  # released while the others recovered
                self.events.put(Left(worker=self.me, step=self._step,
                                     **self._memory()))
                return
            enter = partial(self._resume, recovery, failed)

    def _enter(self, gen: Generation, previous: Generation | None) -> tuple[Trainer, World, int]:
        """Join the first generation this worker trains in."""
        opts = self.opts
        self._gen, self._step = gen, gen.at_step
        if previous is None:
            resume = self.source.resume_from
            world = self._world(gen, gen.world)
            trainer = self._trainer(gen, world, initialise=resume is None)
            step = checkpoint.load(trainer, resume) if resume else gen.at_step
            self.events.put(self._ready(step))
        else:  # a joiner: standby in the new world until the old members arrive
            self.events.put(self._ready(None))
            if compiled.enabled(self.spec.training.compile, self.device):
                self._warm_up(gen)
            world = self._world(gen, gen.world)
            trainer = self._trainer(gen, world, initialise=False)
            self._reshard(self._plan(previous, gen), world, None, trainer)
            step = gen.at_step
        return trainer, world, step

    def _warm_up(self, gen: Generation) -> None:
        """Compile in standby what this joiner's units in ``gen`` run, before the switch."""
        layout = self.source.layout(gen)
        started = time.perf_counter()
        graphs = warm_up_compiled(self.spec, layout, gen.members.index(self.me) % layout.pp,
                                  self.device)
        log.info("%s: compiled %d graphs in standby (%.1f s)", self.me, graphs,
                 time.perf_counter() - started)

    def _ready(self, step: int | None) -> Ready:
        rendezvous = self.opts.rendezvous
        return Ready(worker=self.me, step=step, device=self.where.name,
                     transport=rendezvous.transport, backend=rendezvous.backend,
                     determinism=self.where.determinism)

    def _train(self, enter: Callable[[], tuple[Trainer, World, int]]) -> None:
        """Train from where ``enter`` puts this worker to the last step, or until released."""
        opts, source = self.opts, self.source
        trainer, world, step = enter()
        gen = self._gen
        watch = self._watch(trainer, step)
        self._profile_from(step)
        following = builder = plan = None
        while step < opts.steps:
            self._step = step
            self._held_s = None if self.snapshots is None else 0.0
            if self.snapshots is not None and self.snapshots.due(world, step):
                self.snapshots.take(world, gen.index, source.layout(gen), step,
                                    trainer.state_tensors())
                self._held_s = self.snapshots.seconds
            word = watch.boundary(step) if watch is not None else None
            replan = word.layout if word is not None else None
            if word is not None and word.profile:
                self._profile_from(step)
            leaving = self._stopping and not self.leader  # the leader's source halts the job
            if following is None:
                following = source.following(gen, step)
                if isinstance(following, Halt):  # (the leader's stop comes before mine)
                    self._halt(trainer, step)
                    return
                if following is None and replan is not None:
                    following = source.replan(gen, replan, at_step=step + 1)
                if following is not None and not leaving:
                    # Build its world and plan while this one trains.
                    builder, plan = self._next_builder(following), self._plan(gen, following)
            if leaving:
                log.warning("%s: asked to stop; leaving at step %d", self.me, step)
                if self.snapshots is not None:
                    self.snapshots.settle()  # its newest copy whole at its keeper
                source.depart(self.me, step)
                self.events.put(Left(worker=self.me, step=step, **self._memory()))
                return
            if following is not None and step == following.at_step:
                trainer, world = self._switch(gen, following, trainer, world, builder, plan)
                if trainer is None:
                    self._released(step)
                    return
                gen, following = following, None
                self._gen = gen
                watch = self._watch(trainer, step)
                self._profile_from(step)
                continue
            self._train_step(trainer, step, watch)
            step += 1
        self.events.put(Finished(worker=self.me, digests=trainer.parameter_digests(),
                                 num_params=trainer.num_params,
                                 **self._memory()))

    def _profile_from(self, start: int) -> None:
        """A generation trains from ``start``: profile its first steps (after the switch's cold
        ones), as long as the run has steps enough; every member computes the same window."""
        remaining = self.opts.steps - start
        self._drift.expect(None)  # until the new profile's prediction
        if self.opts.profile_out is None or remaining < 3:
            self._window = (0, 0)
            return
        first, last = profile_window(remaining)
        self._window = (start + first, start + last)

    def _watch(self, trainer: Trainer, step: int) -> StragglerWatch | None:
        """This member's straggler watch in ``trainer``'s world, from ``step`` on."""
        if not self.opts.watch_stragglers:
            for stage in trainer.stages.values():
                stage.layer_clock.on = False  # nobody would empty it
            return None
        return StragglerWatch(self.spec.stragglers, me=self.me, leader=self.leader,
                              trainer=trainer, start=step, detector=self._stragglers,
                              unit_seconds=self.opts.unit_seconds,
                              replans=self.source.replans, drops=self.source.drops,
                              events=self.events)

    def _released(self, step: int) -> None:
        """Let go by a shrink at ``step``: report how long after the end of its last step it was
        free to go (its GPUs with it), then leave."""
        ended = self._last_step_end
        self.events.put(Released(
            worker=self.me, at_step=step,
            release_s=None if ended is None else time.perf_counter() - ended,
            snapshot_s=self._held_s or 0.0,
        ))
        self.events.put(Left(worker=self.me, step=step, **self._memory()))

    def _halt(self, trainer: Trainer, step: int) -> None:
        """Save the boundary the job halts at (every member calls it) and tell the launcher
        where it is."""
        root, path = self.opts.checkpoint_root, None
        if root:
            path = str(checkpoint.save(trainer, root, step, trainer.layout.describe(),
                                       self.state_names))
        log.warning("%s: the job halts at step %d (checkpoint: %s)", self.me, step, path)
        self.events.put(Halted(worker=self.me, step=step, checkpoint=path))

    def _recover(self, err: Exception) -> Recovery | None:
        """Close every world of the failed generation, then ask the source where to go on."""
        log.error("%s failed at step %d of generation %d: %s: %s", self.me, self._step,
                  self._gen.index, type(err).__name__, err)
        self._swapping = self.snapshots is not None and self.snapshots.swapping
        if self.snapshots is not None:
            # Settled first: a ward's copy that arrives whole counts. One that fails (a
            # neighbour lost) does not; the failure itself is this one.
            with contextlib.suppress(RuntimeError):
                self.snapshots.settle(gone=self.source.gone)
        # Aborted and let go, every world of the failed generation (the next one's too, if
        # built) closes its connections now, so members still blocked on this one fail at
        # once, NCCL's included, rather than at the timeout. Operations still held (by the
        # traceback's frames, by a failed swap's error) hold their group's connections: the
        # frames are cleared and the rest collected, over what was made since _run froze the
        # heap (milliseconds; a full collection takes 0.4 s here).
        traceback.clear_frames(err.__traceback__)
        abort_worlds()
        gc.collect()
        held = self.snapshots.summary() if self.snapshots is not None else None
        return self.source.recover(self.me, self._gen, self._step, err, held)

    def _rescue(self) -> None:
        """The rendezvous is lost, so the job is: save the newest boundary the peer snapshots
        hold whole, with the other members, for the operator's restart to start from."""
        held = self.snapshots.summary() if self.snapshots is not None else None
        rescue = self.source.rescue(self.me, self._gen, held)
        if rescue is None:
            return
        gen, cut, store = rescue
        world = build_world(self.opts.rendezvous, gen.index, gen.members, self.me,
                            name="rescue", store=store)
        path = save_cut(cut, me=self.me, world=world, snapshots=self.snapshots,
                        model=self.spec.model, root=self.opts.checkpoint_root)
        log.warning("%s: the rendezvous is lost; the peer snapshots of step %d are saved in %s, "
                    "for the job's restart", self.me, cut.step, path)

    def _resume(self, recovery: Recovery, failed: float) -> tuple[Trainer, World, int]:
        """Go on in the survivors' generation from the peer snapshots, a checkpoint or step 0."""
        gen = recovery.generation
        self._gen, self._step = gen, gen.at_step
        world = self._world(gen, recovery.world)
        fresh = recovery.checkpoint is None and recovery.snapshot is None
        trainer = self._trainer(gen, world, initialise=fresh)
        if recovery.snapshot is not None:
            rebuild(recovery.snapshot, Placement(layout=self.source.layout(gen),
                                                 workers=gen.members),
                    me=self.me, world=world, trainer=trainer, snapshots=self.snapshots,
                    metas=self.metas, bucket_bytes=self.opts.bucket_bytes)
        elif recovery.checkpoint is not None:
            checkpoint.load(trainer, recovery.checkpoint)
        if self.snapshots is not None:
            self.snapshots.clear()  # copies of a world that is gone
        if self.leader:
            self.events.put(Recovered(
                worker=self.me, failed_at=recovery.failed_at, resumed_at=gen.at_step,
                snapshot=recovery.snapshot is not None, checkpoint=recovery.checkpoint,
                lost=recovery.lost, left=recovery.left, generation=gen.index,
                members=gen.members, layout=trainer.layout,
                pause_s=time.perf_counter() - failed, swapping=self._swapping,
            ))
        return trainer, world, gen.at_step

    def _train_step(self, trainer: Trainer, step: int, watch: StragglerWatch | None) -> None:
        first, last = self._window
        profiling = first <= step < last
        if profiling and trainer.runtime.profiler is None:
            trainer.runtime.profiler = UnitProfiler(Clock(self.device))
            self.peaks.start()
        if profiling:  # unit hooks in the first profiled step; the others run plain, timed
            trainer.runtime.profiler.hooks = step == first
        for member, begin, end, factor in self.opts.slowdown:
            if member == self.me:
                trainer.slow_down(factor if begin <= step < end else 1.0)
        started = time.perf_counter()
        if self.tensors is not None:
            self.tensors.reset_peak()
        result = trainer.step(step)
        if self.tensors is not None:  # the step's own, before a profile's calibration
            self._tensor_peak = max(self._tensor_peak, self.tensors.peak)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self._last_step_end = time.perf_counter()
        if self.snapshots is not None:
            self.snapshots.stepped(seconds)
        predicted = self._drift.predicted
        if profiling and step == last - 1:  # part of the step: reported done after it
            self._finish_profile(trainer)
        elif not profiling and self.leader and watch is not None and self._drift.observe(seconds):
            log.warning("step %d: %.1f ms, the %dth step in a row off the profiled %.1f ms by "
                        "more than %.0f%%: profiling again", step, seconds * 1e3,
                        self._drift.steps, predicted * 1e3, self._drift.margin * 100)
            watch.ask_profile()
        if self.leader:
            self.events.put(Stepped(
                worker=self.me, step=result.step, loss=result.loss,
                loss_hex=float.hex(result.loss), grad_norm=result.grad_norm, lr=result.lr,
                seconds=seconds, snapshot_s=self._held_s,
                layout=trainer.layout,
                watch_s=watch.seconds if watch is not None else None,
                speeds=watch.speeds() if watch is not None else {},
                compiled_graphs=compiled.graphs() if trainer.compiled else None,
            ))
        done, opts = step + 1, self.opts
        if opts.checkpoint_every and opts.checkpoint_root and done % opts.checkpoint_every == 0:
            saving = time.perf_counter()
            path = checkpoint.save(trainer, opts.checkpoint_root, done,
                                   trainer.layout.describe(), self.state_names)
            if self.leader:
                self.events.put(Checkpointed(worker=self.me, path=str(path), step=done,
                                             seconds=time.perf_counter() - saving))

    def _finish_profile(self, trainer: Trainer) -> None:
        """Gather every rank's measurements at the leader, which writes the profile JSON."""
        profiler, trainer.runtime.profiler = trainer.runtime.profiler, None
        p2p = trainer.profile_p2p()
        part = {"rank": trainer.world.rank, "pp_rank": trainer.pp_rank,
                "units": profiler.units(), "p2p": p2p,
                "peak_gpu_bytes": self.peaks.window(),  # the profiled steps': before calibrating
                "optimizer_s": statistics.median(profiler.optimizer_s),
                "actions_s": profiler.actions(),
                "steps": profiler.step_parts,
                "collectives_s": time_collectives(trainer),
                "calibration": calibrate_trainer(trainer)}
        store = trainer.world.store
        key = f"profile/{trainer.world.name}{trainer.world.generation}"
        store.set(f"{key}/{trainer.world.rank}", json.dumps(part))
        if not self.leader:
            return
        parts = [json.loads(store.get(f"{key}/{r}")) for r in range(trainer.world.size)]
        profile = build_profile(parts, trainer.layout, self._window, self.spec.model)
        try:
            self._drift.expect(ProfiledPredictor(Profile.from_dict(profile),
                                                 self.spec.model.seq_len)
                               .predict(trainer.layout).step_seconds)
        except ProfileError as err:
            log.warning("the profile of steps %s predicts nothing: %s", self._window, err)
        path = Path(profile_path(self.opts.profile_out, self._profiles))
        self._profiles += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=2) + "\n")
        self.events.put(Profiled(worker=self.me, path=str(path), layout=trainer.layout,
                                 steps=self._window))

    def _next_builder(self, following: Generation) -> WorldBuilder | None:
        """Start building the next generation's world now, while this one trains."""
        if self.me not in following.members:
            return None
        return WorldBuilder(self.opts.rendezvous, following.index, following.members, self.me,
                            name=following.world, cpu_group=self.snapshots is not None,
                            prepare=self._subgroups(following))

    def _world(self, gen: Generation, name: str) -> World:
        """Join a generation's world (with a CPU group for the peer snapshots' swaps), and the
        subgroups its layout needs; not waiting for a member known dead."""
        return self._built(WorldBuilder(self.opts.rendezvous, gen.index, gen.members, self.me,
                                        name=name, cpu_group=self.snapshots is not None,
                                        prepare=self._subgroups(gen)))

    def _built(self, builder: WorldBuilder) -> World:
        """``builder``'s world, or ``MemberGone`` (the fault path) once a member is dead."""
        return builder.result(self.opts.rendezvous.timeout_s, gone=self.source.gone)

    def _subgroups(self, gen: Generation) -> Callable[[World], None]:
        """What builds the subgroups of ``gen``'s layout in its world."""
        return partial(prepare_subgroups, layout=self.source.layout(gen),
                       strict=self.spec.parallelism.consistency == "strict")

    def _plan(self, old: Generation, new: Generation) -> ReshardPlan:
        """A switch's reshard plan, made ahead of it rather than during the pause."""
        return plan_reshard(Placement(layout=self.source.layout(old), workers=old.members),
                            Placement(layout=self.source.layout(new), workers=new.members),
                            self.metas)

    def _switch(self, old: Generation, new: Generation, trainer: Trainer, world: World,
                builder: WorldBuilder | None, plan: ReshardPlan,
                ) -> tuple[Trainer | None, World | None]:
        paused = time.perf_counter()
        self.peaks.start()
        growing = len(new.members) > len(old.members)
        cut = None if growing else self._kept_cut(old, new, world)
        if cut is not None:
            # Every leaver's state at this boundary is with a keeper that stays: the leavers go
            # now, once every keeper holds its copy, and the keepers send in their place.
            self.snapshots.settle()
            world.barrier()
            if self.me not in new.members:
                return None, None
        new_world = self._built(builder) if builder else None
        world_s = time.perf_counter() - paused
        transition = world if cut is None and not growing else new_world
        rebuilt = time.perf_counter()
        new_trainer = None
        if new_world is not None:  # what leaves goes to host memory before what arrives is made
            holds = state_index(self.metas, Placement(layout=self.source.layout(new),
                                                      workers=new.members), self.me)
            kept = carry_over(plan, self.me, trainer, holds)
            new_trainer = self._trainer(new, new_world, initialise=False, kept=kept)
        rebuild_s = time.perf_counter() - rebuilt
        stats = self._reshard(plan, transition, trainer, new_trainer, cut)
        if new_world is not world:
            world.close()  # its communicators now, not whenever the collector gets to them
        if self.leader:
            self.events.put(Reconfigured(
                worker=self.me, at_step=new.at_step, generation=new.index, members=new.members,
                from_layout=self.source.layout(old), to_layout=self.source.layout(new),
                workers=(len(old.members), len(new.members)),
                pause_s=time.perf_counter() - (self._last_step_end or paused),
                world_s=world_s, rebuild_s=rebuild_s, transfer_s=stats.seconds,
                bytes_moved=plan.bytes_moved, bytes_min=plan.bytes_min, buckets=stats.buckets,
                released_at_once=cut is not None, peak_gpu_bytes=self.peaks.window(),
            ))
        return new_trainer, new_world

    def _kept_cut(self, old: Generation, new: Generation, world: World) -> Cut | None:
        """For a shrink, the peer snapshots of this boundary (taken in ``old``'s ``world``) as a
        cut whose leavers' state their keepers send, if every leaver's keeper stays; else None
        (no snapshots, none at this boundary, or two leavers next to each other in the ring):
        the leavers send."""
        leavers = [m for m in old.members if m not in new.members]
        if (self.snapshots is None or not leavers or not keepers_stay(old.members, leavers)
                or not self.snapshots.holds(world, self._step)):
            return None
        keeper = keepers(old.members)
        return Cut(generation=old.index, members=old.members, layout=self.source.layout(old),
                   step=self._step, senders={m: keeper[m] for m in leavers})

    def _reshard(self, plan: ReshardPlan, transition: World, old_trainer: Trainer | None,
                 new_trainer: Trainer | None, cut: Cut | None = None) -> TransferStats:
        """Run ``plan`` on this worker; with ``cut``, its keepers send for its leavers from
        the peer snapshots they hold."""
        held = self.snapshots.held(cut, self.me)[1] if cut is not None else None
        return execute_reshard(
            plan, world=transition, me=self.me,
            old_state=old_trainer.state_tensors() if old_trainer else None,
            new_state=new_trainer.state_tensors() if new_trainer else None,
            bucket_bytes=self.opts.bucket_bytes,
            senders=cut.senders if cut is not None else None, held=held,
        )

"""A worker process: trains its share of each generation it belongs to, and switches live.

Events go back to the launcher on a queue: per-step results and reconfiguration timings from
the leader (``worker-0``, rank 0 of every world), checkpoint paths, parameter digests from
every final member, ``left`` from a worker released by a shrink, and an error line from a
worker that fails.

A switch to generation g+1 happens between two steps, at the same step on every member. The
world of g+1 is built in a background thread while generation g trains; joiners wait in it
(standby) until the old members arrive. State moves over the larger of the two worlds (the new
one when growing, the old one when shrinking), then leavers exit and the others go on.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
import torch

from tidal_agent import checkpoint
from tidal_agent.optim import ClipMode
from tidal_agent.profiler import UnitProfiler, build_profile, calibrate_trainer, time_collectives
from tidal_agent.switch import TransferStats, carry_over, execute_reshard, state_metadata
from tidal_agent.trainer import Trainer, model_config
from tidal_agent.world import Rendezvous, World, WorldBuilder, build_world
from tidal_api import JobSpec
from tidal_plan.elastic import Generation
from tidal_plan.layout import Layout
from tidal_plan.reshard import Placement, ReshardPlan, plan_reshard


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    rendezvous: Rendezvous
    generations: tuple[Generation, ...]
    layouts: tuple[Layout, ...]  # one per generation
    steps: int
    threads: int = 1
    clip_mode: ClipMode = ClipMode.GLOBAL_ORDER
    resume_from: str | None = None  # a checkpoint directory
    checkpoint_root: str | None = None
    checkpoint_every: int = 0  # steps; 0: no periodic checkpoints
    bucket_bytes: int = 256 << 20  # in flight per worker during a reshard
    profile_out: str | None = None  # write the online profile (JSON) here
    profile_steps: tuple[int, int] = (1, 4)  # [first, last) steps profiled; step 0 warms up


def worker_main(me: str, spec_json: str, opts: WorkerOptions, events) -> None:
    """Process entry point (spawned); never raises, reports through ``events``."""
    try:
        _Worker(me, JobSpec.model_validate_json(spec_json), opts, events).run()
    except BaseException as err:  # noqa: BLE001 - the launcher needs every failure, with cause
        events.put(("error", me, f"{type(err).__name__}: {err}", traceback.format_exc()))
        raise SystemExit(1) from None


class _Worker:
    def __init__(self, me: str, spec: JobSpec, opts: WorkerOptions, events) -> None:
        self.me, self.spec, self.opts, self.events = me, spec, opts, events
        # Same threads in every process: part of the determinism contract.
        torch.set_num_threads(opts.threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
        self.device = torch.device("cpu")
        if opts.rendezvous.backend == "nccl":
            self.device = torch.device("cuda", int(me.rsplit("-", 1)[1]) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.metas = state_metadata(model_config(spec))
        self._last_step_end: float | None = None

    @property
    def leader(self) -> bool:
        return self.me == self.opts.generations[0].members[0]

    def _trainer(self, gen: Generation, world: World, *, initialise: bool) -> Trainer:
        return Trainer(spec=self.spec, layout=self.opts.layouts[gen.index], world=world,
                       device=self.device, clip_mode=self.opts.clip_mode, initialise=initialise)

    def run(self) -> None:
        gens, opts = self.opts.generations, self.opts
        gen = next(g for g in gens if self.me in g.members)
        if gen.index == 0:
            world = build_world(opts.rendezvous, 0, gen.members, self.me)
            trainer = self._trainer(gen, world, initialise=opts.resume_from is None)
            step = checkpoint.load(trainer, opts.resume_from) if opts.resume_from else 0
            self.events.put(("ready", self.me, step))
        else:  # a joiner: standby in the new world until the old members arrive
            self.events.put(("ready", self.me, None))
            world = build_world(opts.rendezvous, gen.index, gen.members, self.me)
            trainer = self._trainer(gen, world, initialise=False)
            plan = self._plan(gens[gen.index - 1], gen)
            self._reshard(plan, world, None, trainer)
            step = gen.at_step
        builder, plan = self._next_builder(gen), self._next_plan(gen)
        while step < opts.steps:
            following = gens[gen.index + 1] if gen.index + 1 < len(gens) else None
            if following is not None and step == following.at_step:
                trainer, world = self._switch(gen, following, trainer, world, builder, plan)
                if trainer is None:
                    self.events.put(("left", self.me, step))
                    return
                gen, builder, plan = following, self._next_builder(following), self._next_plan(following)
                continue
            self._train_step(trainer, step)
            step += 1
        self.events.put(("done", self.me, trainer.parameter_digests()))

    def _train_step(self, trainer: Trainer, step: int) -> None:
        first, last = self.opts.profile_steps
        profiling = self.opts.profile_out is not None and first <= step < last
        if profiling and trainer.runtime.profiler is None:
            trainer.runtime.profiler = UnitProfiler()
        if profiling:  # unit hooks in the first profiled step; the others run plain, timed
            trainer.runtime.profiler.hooks = step == first
        started = time.perf_counter()
        result = trainer.step(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self._last_step_end = time.perf_counter()
        if self.leader:
            self.events.put(("step", self.me, {
                "step": result.step, "loss": result.loss, "loss_hex": float.hex(result.loss),
                "grad_norm": result.grad_norm, "lr": result.lr, "seconds": seconds,
                "layout": trainer.layout.to_dict(),
            }))
        if profiling and step == last - 1:
            self._finish_profile(trainer)
        done, opts = step + 1, self.opts
        if opts.checkpoint_every and opts.checkpoint_root and done % opts.checkpoint_every == 0:
            saving = time.perf_counter()
            path = checkpoint.save(trainer, opts.checkpoint_root, done, trainer.layout.describe())
            if self.leader:
                self.events.put(("checkpoint", self.me, {
                    "path": str(path), "step": done, "seconds": time.perf_counter() - saving,
                }))

    def _finish_profile(self, trainer: Trainer) -> None:
        """Gather every rank's measurements at the leader, which writes the profile JSON."""
        profiler, trainer.runtime.profiler = trainer.runtime.profiler, None
        p2p = trainer.profile_p2p()
        part = {"rank": trainer.world.rank, "pp_rank": trainer.pp_rank,
                "units": profiler.units(), "p2p": p2p,
                "optimizer_s": statistics.median(profiler.optimizer_s),
                "actions_s": profiler.actions(),
                "steps": profiler.step_parts,
                "collectives_s": time_collectives(trainer),
                "calibration": calibrate_trainer(trainer)}
        store = trainer.world.store
        key = f"profile/gen{trainer.world.generation}"
        store.set(f"{key}/{trainer.world.rank}", json.dumps(part))
        if not self.leader:
            return
        parts = [json.loads(store.get(f"{key}/{r}")) for r in range(trainer.world.size)]
        profile = build_profile(parts, trainer.layout, self.opts.profile_steps, trainer.config)
        Path(self.opts.profile_out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.opts.profile_out).write_text(json.dumps(profile, indent=2) + "\n")
        self.events.put(("profile", self.me, self.opts.profile_out))

    def _next_builder(self, gen: Generation) -> WorldBuilder | None:
        """Start building the next generation's world now, while this one trains."""
        gens = self.opts.generations
        if gen.index + 1 >= len(gens) or self.me not in gens[gen.index + 1].members:
            return None
        following = gens[gen.index + 1]
        return WorldBuilder(self.opts.rendezvous, following.index, following.members, self.me)

    def _plan(self, old: Generation, new: Generation) -> ReshardPlan:
        layouts = self.opts.layouts
        return plan_reshard(Placement(layout=layouts[old.index], workers=old.members),
                            Placement(layout=layouts[new.index], workers=new.members),
                            self.metas)

    def _next_plan(self, gen: Generation) -> ReshardPlan | None:
        """The next switch's reshard plan, made now rather than during the pause."""
        gens = self.opts.generations
        return self._plan(gen, gens[gen.index + 1]) if gen.index + 1 < len(gens) else None

    def _switch(self, old: Generation, new: Generation, trainer: Trainer, world: World,
                builder: WorldBuilder | None, plan: ReshardPlan,
                ) -> tuple[Trainer | None, World | None]:
        paused = time.perf_counter()
        new_world = builder.result(self.opts.rendezvous.timeout_s) if builder else None
        world_s = time.perf_counter() - paused
        growing = len(new.members) > len(old.members)
        transition = new_world if growing else world
        rebuilt = time.perf_counter()
        new_trainer = self._trainer(new, new_world, initialise=False) if new_world else None
        rebuild_s = time.perf_counter() - rebuilt
        if new_trainer is not None:
            carry_over(plan, self.me, trainer, new_trainer)
        stats = self._reshard(plan, transition, trainer, new_trainer)
        if self.leader:
            self.events.put(("reconfig", self.me, {
                "at_step": new.at_step,
                "from": self.opts.layouts[old.index].to_dict(),
                "to": self.opts.layouts[new.index].to_dict(),
                "workers": [len(old.members), len(new.members)],
                "pause_s": time.perf_counter() - (self._last_step_end or paused),
                "world_s": world_s,
                "rebuild_s": rebuild_s,
                "transfer_s": stats.seconds,
                "bytes_moved": plan.bytes_moved,
                "bytes_min": plan.bytes_min,
                "buckets": stats.buckets,
            }))
        return new_trainer, new_world

    def _reshard(self, plan: ReshardPlan, transition: World,
                 old_trainer: Trainer | None, new_trainer: Trainer | None) -> TransferStats:
        return execute_reshard(
            plan, world=transition, me=self.me,
            old_state=old_trainer.state_tensors() if old_trainer else None,
            new_state=new_trainer.state_tensors() if new_trainer else None,
            bucket_bytes=self.opts.bucket_bytes,
        )

"""The fault path's state moves: a cut of peer snapshots rebuilt in the survivors' layout, or
saved for the job's restart.

After a fault the survivors rebuild the state of the cut their source chose
(tidal_agent.snapshot) with an ordinary reshard plan from the cut's placement, in which the
survivor that keeps a lost member's copy sends in its place (``rebuild``). When the leader is
lost with the rendezvous store the job cannot go on, and the other members save the cut's
copies as they are, a checkpoint the operator's restart loads into any layout (``save_cut``).
The worker (tidal_agent.worker) decides when; this module moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tidal_agent import checkpoint
from tidal_agent.model import global_parameter_names
from tidal_agent.snapshot import Cut, PeerSnapshots
from tidal_agent.switch import execute_reshard, incoming, state_shapes
from tidal_agent.trainer import Trainer
from tidal_agent.world import World
from tidal_api import ModelSpec
from tidal_plan.reshard import Placement, TensorMeta, plan_reshard


def rebuild(cut: Cut, placement: Placement, *, me: str, world: World, trainer: Trainer,
            snapshots: PeerSnapshots, metas: Sequence[TensorMeta], bucket_bytes: int) -> None:
    """Set ``trainer``'s state (``me``'s in ``placement``) to the cut's: a reshard from the
    cut's placement, each lost member's part sent by the survivor that keeps its copy."""
    plan = plan_reshard(Placement(layout=cut.layout, workers=cut.members), placement, metas)
    own, held = snapshots.held(cut, me)
    state = trainer.state_tensors()
    arriving = incoming(plan, me)
    for name, tensor in state.items():
        if name not in arriving:  # held in the cut's placement too
            tensor.view(-1).copy_(own[name])
    execute_reshard(plan, world=world, me=me, old_state=own, new_state=state,
                    bucket_bytes=bucket_bytes, senders=cut.senders, held=held)


def save_cut(cut: Cut, *, me: str, world: World, snapshots: PeerSnapshots,
             model: ModelSpec, root: str) -> Path:
    """Save the cut's copies that ``me`` holds into a checkpoint under ``root``, with the
    other members of ``world``; its directory.

    The copies are saved as they are, in the cut's layout: no trainer of the survivors' layout
    beside them (memory a small job's survivors may not have), and a checkpoint loads into any
    layout. Each survivor writes its own copy and those it keeps for the lost; a name two of
    them hold (replicas) is written once.
    """
    own, kept = snapshots.held(cut, me)
    shapes = state_shapes(model)
    state = {name: view.view(shapes[name]) for copy in (own or {}, *kept.values())
             for name, view in copy.items()}
    return checkpoint.save_state(state, world, root, cut.step, cut.layout.describe(),
                                 list(shapes), len(global_parameter_names(model)))

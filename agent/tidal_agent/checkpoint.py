"""Distributed checkpoints that reload into any layout.

A checkpoint is a directory ``<root>/step-<N>`` of torch.distributed.checkpoint (DCP) parts,
``rank-<r>``, one per rank with something to write, keyed by global names: every parameter
(``blocks.3.mlp.fc1.weight``) and its AdamW state (``…/exp_avg``, ``…/exp_avg_sq``, ``…/step``).
Each name is written once, by the first rank that holds it (data-parallel replicas and tied
copies hold the same names); on load, each rank reads the names it holds in the new layout
from whichever parts have them, so a job saved with 2 workers resumes with 3. Nothing else
needs saving: data, learning rate and dropout are functions of the step.

The ranks agree through their world's own collectives, built with the world ahead of any
switch's pause: no default process group is joined for a save, and a member lost before one
fails the others' at once, by a closed connection. A ``tidal.json`` written last by rank 0
marks a directory as complete, so a crash during a save never leaves a checkpoint that looks
whole. A directory that is one DCP checkpoint (what earlier versions wrote) loads too.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tidal_api.spec import ModelSpec

from tidal_agent.model import global_parameters
from tidal_agent.trainer import Trainer
from tidal_agent.world import World

MARKER = "tidal.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest(root: str | Path, *, at_most: int | None = None) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as (steps done, directory), if any; with
    ``at_most``, the newest of at most that many steps."""
    found = []
    root = Path(root)
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / MARKER).is_file():
                if at_most is None or int(match.group(1)) <= at_most:
                    found.append((int(match.group(1)), child))
    return max(found) if found else None


def save(trainer: Trainer, root: str | Path, steps_done: int, layout_description: str,
         names: Sequence[str]) -> Path:
    """Collectively save this job's state after ``steps_done`` steps; every rank calls it.
    ``names``: every state name of the job, in global order (``state_metadata``'s)."""
    return save_state(trainer.state_tensors(), trainer.world, root, steps_done,
                      layout_description, names, trainer.num_params)


def save_state(state: Mapping[str, torch.Tensor], world: World, root: str | Path,
               steps_done: int, layout_description: str, names: Sequence[str],
               num_params: int) -> Path:
    """:func:`save` of ``state`` (global names, of the job's ``names`` in their order) by the
    ranks of ``world``, each with what it holds; a name two ranks hold is written once."""
    target = step_dir(root, steps_done)
    index = {name: i for i, name in enumerate(names)}
    if unknown := [name for name in state if name not in index]:
        raise ValueError(f"state {unknown[:3]} is not among the job's {len(names)} names")
    held = torch.zeros(len(names), dtype=torch.uint8)
    held[[index[name] for name in state]] = 1
    everyone = torch.empty(world.size * len(names), dtype=torch.uint8, device=world.device)
    world.all_gather_into(everyone, held.to(world.device))
    first = everyone.view(world.size, len(names)).cpu().argmax(dim=0)  # the first holder
    mine = {name: tensor for name, tensor in state.items() if first[index[name]] == world.rank}
    if world.rank == 0 and target.exists():
        shutil.rmtree(target)  # an incomplete earlier attempt at the same step
    world.barrier()
    if mine:
        with _one_process() as dcp:
            dcp.save(mine, checkpoint_id=target / f"rank-{world.rank:05d}", no_dist=True)
    world.barrier()
    if world.rank == 0:
        meta = {"steps_done": steps_done, "layout": layout_description,
                "num_params": num_params}
        (target / MARKER).write_text(json.dumps(meta) + "\n")
    world.barrier()
    return target


@contextmanager
def _one_process() -> Iterator[Any]:
    """DCP (``torch.distributed.checkpoint``) in this process alone (no process group): what
    is asked, so not worth a warning. Imported here, not with the module: it imports DTensor,
    which costs every agent process a second or two at start, and most never write a
    checkpoint to disk."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield dcp


def _parts(directory: Path) -> list[Path]:
    """The DCP directories a checkpoint is made of."""
    if (directory / ".metadata").is_file():  # one DCP checkpoint, as earlier versions wrote
        return [directory]
    return sorted(part for part in directory.glob("rank-*") if part.is_dir())


def _read(state: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Fill ``state`` (global names) in place from the parts of the checkpoint ``directory``
    that hold its names, in this process alone."""
    missing = set(state)
    for part in _parts(directory):
        with _one_process() as dcp:
            names = dcp.FileSystemReader(part).read_metadata().state_dict_metadata.keys()
            if wanted := {name: state[name] for name in names if name in missing}:
                dcp.load(wanted, checkpoint_id=part, no_dist=True)
            missing -= wanted.keys()
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} of the state's names, "
                         f"{sorted(missing)[:3]} among them")


def _marker(directory: Path, num_params: int, verb: str) -> dict:
    """The checkpoint's marker, checked against a model of ``num_params`` parameters."""
    meta = json.loads((directory / MARKER).read_text())
    if meta["num_params"] != num_params:
        raise ValueError(f"checkpoint {directory} holds {meta['num_params']} parameters; this "
                         f"model has {num_params}: {verb} with the model it was saved from")
    return meta


def load_parameters(model: ModelSpec, directory: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint of ``model``, in this process alone (no world): what
    ``tidal export`` writes out."""
    directory = Path(directory)
    if not (directory / MARKER).is_file():
        raise ValueError(f"{directory}: not a complete Tidal checkpoint directory")
    names = global_parameters(model)
    _marker(directory, len(names), "export it")
    state = {name: torch.empty(shape) for name, shape, _ in names}
    _read(state, directory)
    return state


def load(trainer: Trainer, directory: str | Path) -> int:
    """Load a checkpoint into this rank's share of the (possibly different) layout; every
    rank reads what it holds, with no other rank.

    Returns the number of steps done when it was saved.
    """
    directory = Path(directory)
    meta = _marker(directory, trainer.num_params, "resume")
    _read(trainer.state_tensors(), directory)
    return int(meta["steps_done"])

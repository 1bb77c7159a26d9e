"""Distributed checkpoints that reload into any layout.

A checkpoint is a torch.distributed.checkpoint (DCP) directory keyed by global names: every
parameter (``blocks.3.mlp.fc1.weight``) and its AdamW state (``…/exp_avg``, ``…/exp_avg_sq``,
``…/step``). Each rank writes the entries of the units it holds, and on load asks for the
entries of the units it holds in the new layout, so a job saved with 2 workers resumes with 3.
Nothing else needs saving: data, learning rate and dropout are functions of the step.

Directories are ``<root>/step-<N>``; a ``tidal.json`` written last by rank 0 marks one as
complete, so a crash during a save never leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tidal_api.spec import ModelSpec

from tidal_agent.model import global_parameters
from tidal_agent.trainer import Trainer
from tidal_agent.world import World, ensure_default_group

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


def save(trainer: Trainer, root: str | Path, steps_done: int, layout_description: str) -> Path:
    """Collectively save this job's state after ``steps_done`` steps; every rank calls it."""
    return save_state(trainer.state_tensors(), trainer.world, root, steps_done,
                      layout_description, trainer.num_params)


def save_state(state: Mapping[str, torch.Tensor], world: World, root: str | Path,
               steps_done: int, layout_description: str, num_params: int) -> Path:
    """:func:`save` of ``state`` (global names) by the ranks of ``world``, each with what it
    holds. Where ranks hold the same name (data-parallel replicas), it is written once."""
    target = step_dir(root, steps_done)
    ensure_default_group(world)
    if dist.get_rank() == 0 and target.exists():
        shutil.rmtree(target)  # an incomplete earlier attempt at the same step
    dist.barrier()
    dcp.save(dict(state), checkpoint_id=target)
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {"steps_done": steps_done, "layout": layout_description,
                "num_params": num_params}
        (target / MARKER).write_text(json.dumps(meta) + "\n")
    dist.barrier()
    return target


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
    with warnings.catch_warnings():  # DCP warns that it loads in one process: what is asked
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    return state


def load(trainer: Trainer, directory: str | Path) -> int:
    """Load a checkpoint into this rank's share of the (possibly different) layout.

    Returns the number of steps done when it was saved.
    """
    directory = Path(directory)
    meta = _marker(directory, trainer.num_params, "resume")
    state = trainer.state_tensors()
    ensure_default_group(trainer.world)
    dcp.load(state, checkpoint_id=directory)
    return int(meta["steps_done"])

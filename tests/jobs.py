"""The small ElasticTrainingJobs the trainer's multi-process tests run, built in one place."""

from __future__ import annotations

from typing import Any

from tidal_api import ElasticTrainingJob, parse_job
from tidal_plan.gpus import Devices

# The test transport that carries NCCL's rules over gloo (tidal_agent.transport): a run under
# it posts what NCCL could run, or fails saying where it would deadlock.
NCCL_MODEL = Devices(transport="nccl-model")


def small_job(name: str, *, model: dict[str, Any], training: dict[str, Any],
              **sections: Any) -> ElasticTrainingJob:
    """A validated job of 2 to 8 workers with this ``model`` and ``training``; ``sections``
    adds further spec sections (``checkpoint=``, ...) as a manifest spells them."""
    return parse_job({
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": name},
        "spec": {"workers": {"min": 2, "max": 8}, "model": model, "training": training,
                 **sections},
    })

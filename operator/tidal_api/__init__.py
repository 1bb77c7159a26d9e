"""The contract between Tidal's operator and its agents: ElasticTrainingJob types.

Stdlib and pydantic only, so both sides (and the chart's schema tests) can import it
without pulling in torch or kopf.
"""

from tidal_api.spec import (
    API_VERSION,
    GROUP,
    KIND,
    VERSION,
    CheckpointSpec,
    DataSpec,
    ElasticTrainingJob,
    JobSpec,
    JobSpecError,
    ModelSpec,
    ParallelismSpec,
    ScalingSpec,
    TrainingSpec,
    WorkersSpec,
    parse_job,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "VERSION",
    "CheckpointSpec",
    "DataSpec",
    "ElasticTrainingJob",
    "JobSpec",
    "JobSpecError",
    "ModelSpec",
    "ParallelismSpec",
    "ScalingSpec",
    "TrainingSpec",
    "WorkersSpec",
    "parse_job",
]

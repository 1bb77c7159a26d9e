"""The contract between Tidal's operator and its agents: ElasticTrainingJob and scale tables.

Stdlib and pydantic only, so both sides (and the chart's schema tests) can import it
without pulling in torch or kopf.
"""

from tidal_api.scale import DroppedRow, ScaleRow, ScaleTable
from tidal_api.status import AppliedLayout, Arrival, Condition, JobStatus, Phase, Target
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
    ResourcesSpec,
    ScalingSpec,
    TemplateSpec,
    TrainingSpec,
    WorkersSpec,
    parse_job,
)

__all__ = [
    "API_VERSION",
    "AppliedLayout",
    "Arrival",
    "Condition",
    "JobStatus",
    "Phase",
    "Target",
    "GROUP",
    "KIND",
    "VERSION",
    "CheckpointSpec",
    "DataSpec",
    "DroppedRow",
    "ElasticTrainingJob",
    "JobSpec",
    "JobSpecError",
    "ModelSpec",
    "ParallelismSpec",
    "ResourcesSpec",
    "ScaleRow",
    "ScaleTable",
    "ScalingSpec",
    "TemplateSpec",
    "TrainingSpec",
    "WorkersSpec",
    "parse_job",
]

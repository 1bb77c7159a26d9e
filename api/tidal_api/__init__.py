"""The contract between Tidal's operator and its agents: ElasticTrainingJob, layouts, scale tables.

Stdlib and pydantic only, so both sides (and the chart's schema tests) can import it
without pulling in torch or kopf.
"""

from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_api.scale import DroppedRow, ScaleRow, ScaleTable
from tidal_api.status import Arrival, Condition, JobStatus, Phase, Target
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
    "Layout",
    "LayoutError",
    "ModelSpec",
    "ParallelismSpec",
    "ResourcesSpec",
    "ScaleRow",
    "ScaleTable",
    "ScalingSpec",
    "ScheduleKind",
    "TemplateSpec",
    "TrainingSpec",
    "WorkersSpec",
    "parse_job",
]

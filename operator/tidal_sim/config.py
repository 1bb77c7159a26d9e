"""A simulation run's configuration: the policies, the switch and restart costs they pay, the
thresholds they scale up at, and :class:`SimConfig`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal_api.spec import ScalingSpec
from tidal_sim.tables import TABLES_DIR

POLICIES = ("static", "greedy", "flextrain", "tidal")
QUEUES = ("pods", "workloads", "hidden")  # how queued jobs show to decide (module docstring)
HOT_SWITCH_SECONDS = {"small": 2.0, "medium": 4.0, "large": 8.0}
RESTART_SECONDS = {"small": 60.0, "medium": 120.0, "large": 240.0}
RESTART_SAVE_FRACTION = 0.5  # a restart frees the GPUs it gives up once its checkpoint is saved
# The Poisson rule's threshold: greedy has none, flextrain keeps its slides' 0.6, tidal the
# spec's default (settable: SimConfig.threshold, for the trade-off of JCT against queue).
THRESHOLDS = {"greedy": 0.0, "flextrain": 0.6}
DEFAULT_THRESHOLD = ScalingSpec.model_fields["probability_threshold"].default
DEFAULT_LOADED_THRESHOLD = ScalingSpec.model_fields["loaded_threshold"].default


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One run: the policy, the scale tables (``pp`` or ``dp-pp``), cluster and tick."""

    policy: str
    nodes: int
    elastic: str = "pp"
    tick_seconds: float = 600.0
    window_seconds: float = 28800.0
    seed: int = 0
    jitter: float = 0.25  # sigma of the lognormal spread of each switch's pause
    pause_scale: float = 1.0  # multiplies every pause and wait; 0: free, at once (a diagnostic)
    # tidal's jobs keep peer snapshots (their per-step cost is not modelled): a scale-down
    # whose leavers' keepers stay frees their GPUs at the step boundary
    peer_snapshots: bool = False
    threshold: float = DEFAULT_THRESHOLD  # tidal's probabilityThreshold
    # tidal's loadedThreshold: its threshold slides toward it as the cluster fills (the
    # peers hold theirs)
    loaded_threshold: float = DEFAULT_LOADED_THRESHOLD
    # elastic jobs (not static's) may start with this fraction of their request (0: off)
    start_below: float = 0.0
    queue: str = "pods"  # how queued jobs show to decide: QUEUES
    tables_dir: Path = TABLES_DIR

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.elastic not in ("pp", "dp-pp"):
            raise ValueError(f"elastic must be pp or dp-pp, got {self.elastic!r}")
        if self.queue not in QUEUES:
            raise ValueError(f"queue must be one of {', '.join(QUEUES)}, got {self.queue!r}")
        if (self.nodes < 1 or self.tick_seconds <= 0 or self.jitter < 0
                or self.pause_scale < 0 or not 0 <= self.threshold < 1
                or not 0 <= self.loaded_threshold < 1 or not 0 <= self.start_below <= 1):
            raise ValueError("need nodes >= 1, tick_seconds > 0, jitter >= 0, pause_scale >= 0, "
                             "0 <= threshold < 1, 0 <= loaded_threshold < 1 and "
                             "0 <= start_below <= 1")

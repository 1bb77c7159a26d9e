"""Label, annotation and environment keys shared by the operator, the agent and the chart."""

from __future__ import annotations

PREFIX = "tidal.dev"

# Labels on every worker pod and on the headless Service.
JOB_LABEL = f"{PREFIX}/job"  # the ElasticTrainingJob's name
ROLE_LABEL = f"{PREFIX}/role"  # "worker"
WORKER_LABEL = f"{PREFIX}/worker"  # the worker's index: worker-0 is the stable leader
GENERATION_LABEL = f"{PREFIX}/generation"  # the generation the pod was created for
ELASTIC_LABEL = f"{PREFIX}/elastic"  # "true" on elastic workers: the policy tells them apart
MANAGED_BY = "app.kubernetes.io/managed-by"

# Environment of a worker pod: how the agent finds its job and its rendezvous.
ENV_JOB = "TIDAL_JOB"
ENV_NAMESPACE = "TIDAL_NAMESPACE"
ENV_POD = "TIDAL_POD"
ENV_RENDEZVOUS_HOST = "TIDAL_RENDEZVOUS_HOST"
ENV_RENDEZVOUS_PORT = "TIDAL_RENDEZVOUS_PORT"
RENDEZVOUS_PORT = 29400
ENV_METRICS_PORT = "TIDAL_METRICS_PORT"  # the agent serves Prometheus metrics there
ENV_LOST_AFTER = "TIDAL_LOST_AFTER"  # tidal agent --lost-after: the heartbeat backstop
METRICS_PORT = 9400

# The agent's exit status once it stopped when asked (SIGTERM's, 128 + 15) without leaving as a
# member does: the leader that halted the job, or a worker whose step failed while stopping.
# The operator restarts a job whose leader exits so and counts it no failure.
STOPPED_EXIT_CODE = 143

# PriorityClasses the chart installs: elastic workers yield to everything else.
ELASTIC_PRIORITY_CLASS = "tidal-elastic"
DEFAULT_PRIORITY_CLASS = "tidal-default"

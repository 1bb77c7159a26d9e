"""The Helm chart and the Dockerfile, checked with the real tools (issue 7, items 1 to 3).

Every scenario in charts/tidal/ci passes ``helm lint --strict`` and renders with ``helm
template`` into objects that kubernetes-validate accepts against the Kubernetes 1.33 schemas
(strict: an unknown field fails). The prometheus-operator kinds (ServiceMonitor, PodMonitor)
have no schema there and no CRD offline: they are checked instead against what they must
select, the metrics Service and the pods the operator builds. values.schema.json refuses bad
values with messages that name the value. The RBAC rules are compared with the requests the
real operator and the agent's control link make against the emulator, as the identities the
chart creates: a rule nothing uses fails, as does a permission missing or a wildcard. The
chart installs on the emulator with helm v4, and kubectl v1.33 gets what it created.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Event, Pod
from lightkube.types import PatchType

from tests import tools
from tests.integration.test_operator import ETJ, table, wait_for
from tidal_api import keys, parse_job
from tidal_kube import localcluster
from tidal_operator import builders
from tidal_operator.main import main as operator_main
from tidal_kube.apiserver import parse_path
from tidal_kube.serving import EmulatorThread, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tidal"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES = "1.33.0"
MONITORING = "monitoring.coreos.com/v1"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: helm renders such a template, and
    the API server would silently keep one of them."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys_ = [self.construct_object(key, deep=deep) for key, _ in node.value]
        if len(keys_) != len(set(keys_)):
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {sorted(k for k in keys_ if keys_.count(k) > 1)}",
                node.start_mark)
        return super().construct_mapping(node, deep)


def helm(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/tidal-helm-cache",
           "HELM_CONFIG_HOME": "/tmp/tidal-helm-config", "HELM_DATA_HOME": "/tmp/tidal-helm-data"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run([str(tools.helm()), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def kubectl(kubeconfig: Path, *args: str) -> str:
    done = subprocess.run([str(tools.kubectl()), "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def render(*args: str, namespace: str = "tidal") -> list[dict[str, Any]]:
    """The objects ``helm template`` renders (with extra helm arguments)."""
    done = helm("template", "tidal", str(CHART), "--namespace", namespace, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.load_all(done.stdout, Loader=UniqueKeyLoader) if doc]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} rendered"
    return found[0]


def tiny_job(namespace: str = "tidal") -> Any:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": "tiny", "namespace": namespace}
    return parse_job(doc)


# ---- lint, render, validate ---------------------------------------------------------------------


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_helm_lint_strict_passes(values):
    done = helm("lint", "--strict", str(CHART), "-f", str(values))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_every_rendered_object_is_valid_kubernetes(values):
    objs = render("-f", str(values))
    assert {"Deployment", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
            "ServiceAccount"} <= {o["kind"] for o in objs}
    for obj in objs:
        if obj["apiVersion"] == MONITORING:
            check_monitor(obj, objs)
        else:
            try:
                kubernetes_validate.validate(obj, KUBERNETES, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = ".".join(map(str, err.path))
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {path}: {err.message}")


def test_the_validation_refuses_an_unknown_field():
    deployment = one(render(), "Deployment")
    deployment["spec"]["template"]["spec"]["serviceAcountName"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError, match="serviceAcountName"):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def check_monitor(monitor: dict, objs: list[dict]) -> None:
    """A ServiceMonitor must select the metrics Service and its port; a PodMonitor the worker
    pods the operator builds, on the agents' metrics port."""
    spec = monitor["spec"]
    assert [e["honorLabels"] for e in spec.get("endpoints", spec.get("podMetricsEndpoints"))] \
        == [True], "both sides label series with namespace and job: honour them"
    if monitor["kind"] == "ServiceMonitor":
        service = one(objs, "Service")
        assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert spec["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
        assert {e["port"] for e in spec["endpoints"]} <= {p["name"] for p in
                                                           service["spec"]["ports"]}
    else:
        assert monitor["kind"] == "PodMonitor", monitor["kind"]
        pod = builders.worker_pod(tiny_job(), uid="u", index=0, generation=0)
        assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        job_namespaces = {o["metadata"]["namespace"] for o in objs if o["kind"] == "Role"}
        assert set(spec["namespaceSelector"]["matchNames"]) == job_namespaces
        port = yaml.safe_load((CHART / "ci" / "monitoring-values.yaml").read_text())[
            "metrics"]["podMonitor"]["port"]
        [relabel] = spec["podMetricsEndpoints"][0]["relabelings"]
        assert relabel["targetLabel"] == "__address__"
        assert relabel["replacement"] == f"${{1}}:{port}"


def test_monitors_are_off_by_default_and_the_dashboard_is_on():
    objs = render()
    assert not [o for o in objs if o["apiVersion"] == MONITORING]
    dashboard = one(objs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tidal.json"]) == json.loads(
        (CHART / "dashboards" / "tidal.json").read_text())


def test_the_chart_crd_is_the_repository_crd():
    name = "elastictrainingjobs.tidal.dev.yaml"
    assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), \
        "run: python tools/gen_crd.py"
    assert [p.name for p in (CHART / "crds").iterdir()] == [name]


# ---- values.schema.json ------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "where", "message"), [
    (["--set", "operator.replicas=2"], "/operator/replicas", "value must be 1"),
    (["--set", "operator.resources.requests.cpu=-1"], "/operator/resources/requests/cpu",
     "minimum: got -1, want 0"),
    (["--set-string", "operator.resources.limits.memory=-512Mi"],
     "/operator/resources/limits/memory", "does not match pattern"),
    (["--set", "surprise=1"], "at ''", "additional properties 'surprise' not allowed"),
    (["--set", "operator.imagePullPolicy=Always"], "/operator",
     "additional properties 'imagePullPolicy' not allowed"),
    (["--set", "operator.image.pullPolicy=Sometimes"], "/operator/image/pullPolicy",
     "value must be one of 'IfNotPresent', 'Always', 'Never'"),
    (["--set", "operator.metricsPort=70000"], "/operator/metricsPort", "maximum"),
    (["--set", "workers.extraNamespaces={Team_A}"], "/workers/extraNamespaces/0",
     "'Team_A' does not match pattern"),
    (["--set", "metrics.serviceMonitor.interval=often"], "/metrics/serviceMonitor/interval",
     "does not match pattern"),
], ids=["replicas", "negative-cpu", "negative-memory", "unknown-key", "misplaced-key",
        "pull-policy", "port", "namespace", "interval"])
def test_values_schema_refuses_bad_values_saying_where(args, where, message):
    done = helm("template", "tidal", str(CHART), *args)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert where in done.stderr and message in done.stderr, done.stderr


def test_one_replica_is_enforced_by_the_template_too():
    done = helm("template", "tidal", str(CHART), "--skip-schema-validation",
                "--set", "operator.replicas=2")
    assert done.returncode != 0
    assert "operator.replicas must be 1: the operator runs kopf standalone" in done.stderr


# ---- what the objects promise ------------------------------------------------------------------


def test_the_operator_deployment_is_hardened_probed_and_single():
    objs = render()
    deployment = one(objs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_user("operator")
    [container] = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {
        "drop": ["ALL"]}
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert "memory" in container["resources"]["limits"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args["liveness"] == f"http://0.0.0.0:{ports['health']}/healthz"
    assert int(args["metrics-port"]) == ports["metrics"]
    assert args["worker-lost-after"] == "5"  # workers.lostAfterSeconds
    # Every rendered flag is one the operator takes.
    params = operator_main.make_context("tidal-operator", list(container["args"])).params
    assert params["worker_lost_after"] == 5.0 and params["gpu_resource"] == "nvidia.com/gpu"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    binding = one(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "tidal"}]
    assert binding["roleRef"]["name"] == one(objs, "ClusterRole")["metadata"]["name"]
    service = one(objs, "Service")
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_names_the_operator_relies_on_are_the_ones_installed():
    objs = render("-f", str(CHART / "ci" / "custom-values.yaml"))
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PriorityClass"}
    assert classes.keys() == {keys.ELASTIC_PRIORITY_CLASS, keys.DEFAULT_PRIORITY_CLASS}
    elastic, default = classes[keys.ELASTIC_PRIORITY_CLASS], classes[keys.DEFAULT_PRIORITY_CLASS]
    assert elastic["value"] < 0 < default["value"], "elastic workers yield to every other pod"
    assert elastic["preemptionPolicy"] == "Never"
    assert not elastic["globalDefault"] and not default["globalDefault"]
    job_namespaces = {"tidal", "team-a", "team-b"}
    pod = builders.worker_pod(tiny_job(), uid="u", index=0, generation=0)
    account = pod["spec"]["serviceAccountName"]
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        named = {o["metadata"]["namespace"] for o in objs
                 if o["kind"] == kind and o["metadata"]["name"] == account}
        assert named == job_namespaces, kind
    assert pod["spec"]["priorityClassName"] in classes


def test_the_local_cluster_creates_what_the_chart_installs_around_the_operator():
    """``tidal local`` stands in for ``helm install``: the same CRD, PriorityClasses and
    workers' ServiceAccount (the chart's labels aside)."""
    from tidal_local.cluster import prerequisites

    def essence(obj: dict) -> dict:
        meta = {k: v for k, v in obj["metadata"].items() if k in ("name", "namespace")}
        return {**{k: v for k, v in obj.items() if k != "metadata"}, "metadata": meta}

    rendered = render(namespace="default")
    chart = [essence(o) for o in rendered if o["kind"] == "PriorityClass"]
    chart += [essence(o) for o in rendered if o["kind"] == "ServiceAccount"
              and o["metadata"]["name"] == builders.WORKER_SERVICE_ACCOUNT]
    [crd] = (CHART / "crds").iterdir()
    chart.append(yaml.safe_load(crd.read_text()))
    local = prerequisites("default")
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(essence, local), key=key) == sorted(map(essence, chart), key=key)


# ---- RBAC: least privilege, spelled out --------------------------------------------------------


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every combination a list of rules allows."""
    return {(group, resource, verb) for rule in rules for group in rule.get("apiGroups", ())
            for resource in rule.get("resources", ()) for verb in rule.get("verbs", ())}


def loose_rules(rules: list[dict]) -> list[dict]:
    """Rules with a wildcard, a non-resource URL or nothing named."""
    return [rule for rule in rules
            if "nonResourceURLs" in rule or not all(rule.get(f) for f in ("resources", "verbs"))
            or any("*" in value for f in ("apiGroups", "resources", "verbs", "resourceNames")
                   for value in rule.get(f, ()))]


def test_the_wildcard_check_can_fail():
    assert loose_rules([{"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}])
    assert loose_rules([{"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]}])
    assert loose_rules([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
    assert not loose_rules([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}])


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_rbac_rules_have_no_wildcards(values):
    for obj in render("-f", str(values)):
        if obj["kind"] in ("ClusterRole", "Role"):
            assert not loose_rules(obj["rules"]), f"{obj['kind']} {obj['metadata']['name']}"


def rbac_request(request: Any) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) that RBAC checks for a recorded request; None
    for discovery and other non-resource URLs (allowed to every authenticated user)."""
    path = parse_path(request.url.path)
    if path.group is None or path.plural is None:
        return None
    method, named = getattr(request.method, "value", request.method), path.name is not None
    if method == "GET":
        verb = "watch" if request.params.get("watch") in ("true", "1") else (
            "get" if named else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if named else "deletecollection"}[method]
    resource = f"{path.plural}/{path.subresource}" if path.subresource else path.plural
    return path.group, resource, verb


def used_by(cluster: EmulatorThread, token: str) -> set[tuple[str, str, str]]:
    requests = cluster.call(lambda: list(cluster.emulator.requests))
    return {found for r in requests if r.headers.get("Authorization") == f"Bearer {token}"
            and (found := rbac_request(r))}


def compare(granted: set, used: set, who: str) -> None:
    assert used, f"no request seen from {who}"
    assert not used - granted, f"{who} needs rules for {sorted(used - granted)}"
    assert not granted - used, f"{who} has rules nothing uses: {sorted(granted - used)}"


def test_the_queue_sources_are_read_only_and_can_be_turned_off():
    """On (the default): list and watch on exactly the Workload and PodGroup resources. Off:
    neither rule, and the operator is told not to watch them."""
    queues = {("kueue.x-k8s.io", "workloads"), ("scheduling.volcano.sh", "podgroups")}

    def rules_and_args(*args: str) -> tuple[set, dict]:
        objs = render(*args)
        granted = grants(one(objs, "ClusterRole")["rules"])
        container = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        params = operator_main.make_context("tidal-operator", list(container["args"])).params
        return {g for g in granted if g[:2] in queues}, params

    granted, params = rules_and_args()
    assert granted == {(*q, verb) for q in queues for verb in ("list", "watch")}
    assert params["kueue"] and params["volcano"]
    granted, params = rules_and_args("-f", str(CHART / "ci" / "minimal-values.yaml"))
    assert granted == set() and not params["kueue"] and not params["volcano"]
    granted, params = rules_and_args("--set", "queues.volcano.enabled=false")
    assert {g[0] for g in granted} == {"kueue.x-k8s.io"}
    assert params["kueue"] and not params["volcano"]


# ---- the Dockerfile ----------------------------------------------------------------------------

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def dockerfile_stage(target: str) -> str:
    match = re.search(rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert match, f"no stage {target} in the Dockerfile"
    return match[1]


def dockerfile_user(target: str) -> int:
    [user] = re.findall(r"^USER (\d+):(\d+)$", dockerfile_stage(target), re.M)
    return int(user[0])


def dockerfile_arg(name: str) -> list[str]:
    return re.search(rf'^ARG {name}="([^"]*)"', DOCKERFILE, re.M)[1].split()


@pytest.mark.parametrize(("target", "entrypoint"), [
    ("operator", ["tidal-operator"]), ("agent", ["tidal", "agent"])])
def test_dockerfile_targets_run_the_console_scripts_as_a_user(target, entrypoint):
    stage = dockerfile_stage(target)
    [line] = re.findall(r"^ENTRYPOINT (.*)$", stage, re.M)
    assert json.loads(line) == entrypoint
    assert entrypoint[0] in PYPROJECT["project"]["scripts"]
    assert dockerfile_user(target) != 0
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS base$", DOCKERFILE, re.M)
    assert re.search(r'^ARG PYTHON_IMAGE=python:3\.11-slim$', DOCKERFILE, re.M)


def test_the_charts_default_image_is_the_operator_target():
    image = VALUES["operator"]["image"]
    tag = image["tag"] or CHART_META["appVersion"]
    assert CHART_META["appVersion"] == PYPROJECT["project"]["version"]
    assert f"docker build --target operator -t {image['repository']}:{tag} ." in DOCKERFILE
    deployment = one(render(), "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"{image['repository']}:{tag}"
    pod = builders.worker_pod(tiny_job(), uid="u", index=0, generation=0)
    assert pod["spec"]["containers"][0]["command"] == ["tidal", "agent"]


def test_the_builders_requirement_split_runs_on_pyproject(tmp_path):
    """The builder stage's script, run here on this pyproject.toml."""
    script = re.search(r"RUN python - <<'EOF'\n(.*?)\nEOF\n", DOCKERFILE, re.S)[1]
    env = {**os.environ, "OPERATOR_REQUIREMENTS": " ".join(dockerfile_arg(
        "OPERATOR_REQUIREMENTS")), "AGENT_EXCLUDED": " ".join(dockerfile_arg("AGENT_EXCLUDED"))}
    done = subprocess.run([sys.executable, "-c", script.replace("/wheels/", f"{tmp_path}/")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    operator = (tmp_path / "operator.txt").read_text().split()
    agent = (tmp_path / "agent.txt").read_text().split()
    pins = PYPROJECT["project"]["dependencies"]
    assert len(operator) == len(dockerfile_arg("OPERATOR_REQUIREMENTS")) and set(operator) <= set(
        pins)
    assert not any(p.startswith("torch") for p in operator)
    assert any(p.startswith("torch==") for p in agent)
    assert not {p for p in agent if p.split("==")[0] in dockerfile_arg("AGENT_EXCLUDED")}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (``PyYAML==6`` -> ``pyyaml``)."""
    return re.split(r"[\s=<>!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace(
        "_", "-").replace(".", "-")


def _closure(names: set[str]) -> set[str]:
    """Installed distributions ``names`` need, themselves included."""
    todo, seen = list(names), set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = importlib.metadata.requires(dist) or ()
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform
        todo += [_name(req) for req in requires if "extra ==" not in req]
    return seen


def hidden_modules(keep: list[str]) -> list[str]:
    """Top-level modules that an image with only ``keep`` of pyproject's dependencies lacks."""
    pins = {_name(p) for p in PYPROJECT["project"]["dependencies"]}
    dropped = _closure(pins) - _closure({_name(k) for k in keep})
    return sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                  if {_name(d) for d in dists} <= dropped and module.isidentifier())


def run_hiding(modules: list[str], code: str) -> subprocess.CompletedProcess:
    """Python ``code`` with these modules made unimportable."""
    return subprocess.run(
        [sys.executable, "-c", f"import sys\nfor m in {modules!r}: sys.modules[m] = None\n{code}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)


def console_script(name: str, *argv: str) -> str:
    """Code that runs a console script of pyproject.toml with ``argv``."""
    module, function = PYPROJECT["project"]["scripts"][name].split(":")
    return f"sys.argv = [{name!r}, *{list(argv)!r}]\nfrom {module} import {function}\n{function}()"


def test_the_operator_image_needs_no_torch():
    hidden = hidden_modules(dockerfile_arg("OPERATOR_REQUIREMENTS"))
    assert {"torch", "numpy", "rich"} <= set(hidden)
    done = run_hiding(hidden, console_script("tidal-operator", "--help"))
    assert done.returncode == 0, done.stderr
    assert "--liveness" in done.stdout
    # The hiding works: without kopf, the operator cannot start.
    assert run_hiding(["kopf"], console_script("tidal-operator", "--help")).returncode != 0


def test_the_agent_image_runs_without_what_it_leaves_out():
    excluded = {_name(n) for n in dockerfile_arg("AGENT_EXCLUDED")}
    hidden = hidden_modules([p for p in PYPROJECT["project"]["dependencies"]
                             if _name(p) not in excluded])
    assert {"matplotlib", "aws_cdk"} <= set(hidden)
    every_module = ("import importlib, pkgutil, tidal_agent, tidal_plan\n"
                    "for package in (tidal_agent, tidal_plan):\n"
                    "    prefix = package.__name__ + '.'\n"
                    "    for info in pkgutil.walk_packages(package.__path__, prefix):\n"
                    "        importlib.import_module(info.name)\n")
    done = run_hiding(hidden, every_module + console_script("tidal", "agent", "--help"))
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout


# ---- on the emulator: helm install, kubectl get, and RBAC against real requests ----------------


@pytest.fixture
def installed(tmp_path):
    """An emulator with the chart installed by helm in namespace tidal (created by helm)."""
    with EmulatorThread(kubeconfig=tmp_path / "kubeconfig") as cluster:
        done = helm("install", "tidal", str(CHART), "--namespace", "tidal", "--create-namespace",
                    kubeconfig=cluster.kubeconfig)
        assert done.returncode == 0, done.stderr
        yield cluster
    assert not cluster.emulator.failures, cluster.emulator.failures


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_helm_installs_on_the_emulator_and_kubectl_gets_what_it_created(installed):
    config = installed.kubeconfig

    def get(*args: str) -> dict:
        return json.loads(kubectl(config, "get", *args, "-o", "json"))

    deployment = get("-n", "tidal", "deployment", "tidal-operator")
    assert deployment["spec"]["replicas"] == 1
    accounts = get("-n", "tidal", "serviceaccounts")["items"]
    assert {"tidal-operator", "tidal-worker"} <= {a["metadata"]["name"] for a in accounts}
    assert get("-n", "tidal", "role", "tidal-worker")["rules"]
    assert get("-n", "tidal", "rolebinding", "tidal-worker")["subjects"][0]["name"] == \
        "tidal-worker"
    assert get("clusterrole", "tidal-operator")["rules"]
    assert get("clusterrolebinding", "tidal-operator")["subjects"][0]["namespace"] == "tidal"
    classes = {c["metadata"]["name"]: c["value"] for c in get("priorityclasses")["items"]}
    assert classes[keys.ELASTIC_PRIORITY_CLASS] < classes[keys.DEFAULT_PRIORITY_CLASS]
    dashboard = get("-n", "tidal", "configmap", "tidal-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert get("-n", "tidal", "service", "tidal-operator-metrics")["spec"]["ports"][0][
        "port"] == 9090
    crd = get("crd", "elastictrainingjobs.tidal.dev")
    assert crd["spec"]["names"]["shortNames"] == ["etj"]
    table_ = kubectl(config, "get", "-n", "tidal", "deployment,serviceaccount,priorityclass")
    assert "tidal-operator" in table_ and "tidal-elastic" in table_

    # A job in the release namespace, as the README says; kubectl prints the CRD's columns.
    kubectl(config, "apply", "-n", "tidal", "-f", str(ROOT / "examples" / "elastic-small.yaml"))
    header, row = kubectl(config, "get", "-n", "tidal", "etj").splitlines()
    assert header.split() == ["NAME", "WORKERS", "PP", "DP", "STEP", "PHASE", "AGE"]
    assert row.split()[0] == "elastic-small"

    # An upgrade changes the Deployment; an uninstall keeps the CRD (and so every job).
    done = helm("upgrade", "tidal", str(CHART), "-n", "tidal", "--set", "operator.interval=5",
                kubeconfig=config)
    assert done.returncode == 0, done.stderr
    args = get("-n", "tidal", "deployment", "tidal-operator")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--interval=5" in args
    assert "deployed" in helm("status", "tidal", "-n", "tidal", kubeconfig=config).stdout
    done = helm("uninstall", "tidal", "-n", "tidal", kubeconfig=config)
    assert done.returncode == 0, done.stderr
    assert "tidal-operator" not in kubectl(config, "get", "-n", "tidal", "deployments")
    assert get("-n", "tidal", "etj", "elastic-small")["metadata"]["name"] == "elastic-small"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rbac_grants_exactly_what_the_operator_and_the_agent_use(installed, tmp_path):
    """The operator runs a job through creation, a scale-up and a drain-deadline scale-down
    (its pods created and deleted, its Service, status and Events written) in a cluster that
    runs Kueue and Volcano (their demand read); the agent's
    control link reads the job, watches it, publishes status and posts an Event. Each runs as the
    ServiceAccount the chart made, told apart by its token."""
    from tidal_agent.link import ControlLink

    ns = "tidal"
    operator_token = f"system:serviceaccount:{ns}:tidal-operator"
    worker_token = f"system:serviceaccount:{ns}:{builders.WORKER_SERVICE_ACCOUNT}"
    url = installed.url
    admin = Client(KubeConfig.from_file(installed.kubeconfig).get())
    localcluster.register_nodes(url, count=1, gpus_per_node=4)
    for crd in localcluster.queue_crds("kueue", "volcano"):  # the queues' demand is read
        installed.call(installed.emulator.create, crd)
    scheduler = installed.submit(localcluster.run(url, interval_s=0.1))
    log = (tmp_path / "operator.log").open("w")
    operator = subprocess.Popen(
        [str(Path(sys.executable).with_name("tidal-operator")), "--interval", "0.3",
         "--kubeconfig", str(write_kubeconfig(tmp_path / "operator", url, ns, operator_token))],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        job = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        job["metadata"] = {"name": "tiny", "namespace": ns}
        job["spec"]["scaling"] = {"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                                  "switchOverheadSeconds": 1, "drainTimeoutSeconds": 2}
        admin.create(ETJ(job))

        workers = {keys.JOB_LABEL: "tiny", keys.ROLE_LABEL: "worker"}  # not its rendezvous

        def pods() -> list[str]:
            return sorted(p.metadata.name for p in admin.list(Pod, namespace=ns, labels=workers))

        def status() -> dict:
            return admin.get(ETJ, "tiny", namespace=ns).get("status") or {}

        wait_for("two worker pods", lambda: len(pods()) == 2, seen=pods)
        admin.patch(ETJ.Status, "tiny", {"status": {
            "generation": 0, "members": pods(), "lastSwitchSeconds": 0.5,
            "scaleTable": table("tiny", {2: 100.0, 3: 140.0, 4: 175.0})}},
            namespace=ns, patch_type=PatchType.MERGE)
        # As the leader would: switch once the target is out and its joiners run.
        wait_for("the scale-up target",
                 lambda: (status().get("target") or {}).get("generation") == 1, seen=status)
        wait_for("four running workers", lambda: sum(
            p.status.phase == "Running" for p in admin.list(
                Pod, namespace=ns, labels=workers)) == 4, seen=pods)
        admin.patch(ETJ.Status, "tiny", {"status": {"generation": 1, "members": pods()}},
                    namespace=ns, patch_type=PatchType.MERGE)
        admin.create(Pod.from_dict({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "batch", "namespace": ns},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {
                "limits": {"nvidia.com/gpu": 2}}}]}}))
        wait_for("released pods deleted at the drain deadline", lambda: len(pods()) == 2,
                 seen=pods)

        link = ControlLink("tiny", ns, kubeconfig=str(write_kubeconfig(
            tmp_path / "worker", url, ns, worker_token)), publish_interval_s=0.1,
            watch_timeout_s=1)
        link.job()
        link.start()
        try:
            link.publish(step=7, loss=3.5)
            link.event("Straggler", "step 7: tiny-worker-1 is a straggler", warning=True)
            wait_for("the agent's status", lambda: status().get("step") == 7, seen=status)
            wait_for("the agent's Event", lambda: any(
                e.reason == "Straggler" for e in admin.list(Event, namespace=ns)))
            time.sleep(0.5)  # the watch is up
        finally:
            link.close()
    finally:
        operator.terminate()
        operator.wait(timeout=30)
        log.close()
        scheduler.cancel()
        admin.close()

    rules = {obj["kind"]: obj["rules"] for obj in render(namespace=ns)
             if obj["kind"] in ("ClusterRole", "Role")}
    compare(grants(rules["ClusterRole"]), used_by(installed, operator_token), "the operator")
    compare(grants(rules["Role"]), used_by(installed, worker_token), "the agent")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_helm_installs_as_documented_over_what_tidal_local_up_created(tmp_path):
    """``helm install tidal charts/tidal --namespace tidal --create-namespace`` against ``tidal
    local up``, which created the CRD, the PriorityClasses and the workers' ServiceAccount in
    the chart's stead: Helm adopts them (it refused before: "invalid ownership metadata")."""
    from tidal_local.cluster import ClusterConfig, LocalCluster

    with LocalCluster(ClusterConfig(workdir=tmp_path / "local", nodes=1,
                                    gpus_per_node=1)) as cluster:
        config = cluster.kubeconfig
        done = helm("install", "tidal", str(CHART), "--namespace", "tidal", "--create-namespace",
                    kubeconfig=config)
        assert done.returncode == 0, done.stderr
        classes = json.loads(kubectl(config, "get", "priorityclasses", "-o", "json"))["items"]
        labels = {c["metadata"]["name"]: c["metadata"].get("labels", {}) for c in classes}
        for name in (keys.ELASTIC_PRIORITY_CLASS, keys.DEFAULT_PRIORITY_CLASS):
            assert labels[name]["app.kubernetes.io/instance"] == "tidal", labels  # the chart's
        # The workers' ServiceAccount that local up made in its namespace is adopted as well.
        done = helm("upgrade", "tidal", str(CHART), "--namespace", "tidal",
                    "--set", "workers.extraNamespaces={default}", kubeconfig=config)
        assert done.returncode == 0, done.stderr
        account = json.loads(kubectl(config, "get", "-n", "default", "serviceaccount",
                                     builders.WORKER_SERVICE_ACCOUNT, "-o", "json"))
        assert account["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
        assert "deployed" in helm("status", "tidal", "-n", "tidal", kubeconfig=config).stdout
        cluster.check()  # the API served every request helm and kubectl made


def test_the_images_wheel_holds_no_test_doubles(tmp_path):
    """The builder stage copies what its COPY lines name (the context .dockerignore lets
    through) and builds one wheel for both images: the product's packages, not tidal_kube nor
    tidal_local (DESIGN.md section 1: the operator image never contains the doubles)."""
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    assert "doubles" not in allowed
    copies = re.findall(r"^COPY (?!--)(.+) \S+$", dockerfile_stage("builder"), re.M)
    (tmp_path / "src").mkdir()
    for source in (path.rstrip("/") for line in copies for path in line.split()):
        assert source in allowed, f"COPY {source} is not in the build context"
        copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy
        copy(ROOT / source, tmp_path / "src" / source)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheels"),
                           str(tmp_path / "src")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "wheels").glob("tidal-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packages = {name.split("/")[0] for name in archive.namelist() if "/" in name}
    assert {"tidal_api", "tidal_plan", "tidal_agent", "tidal_operator", "tidal_sim",
            "tidal_cli"} <= packages
    assert not packages & {"tidal_kube", "tidal_local"}, packages

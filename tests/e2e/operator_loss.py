"""The operator lost while it scales (issue 38): ``tidal-operator`` killed (SIGKILL) again and
again in one run of ``tidal local``, each time while a scale-up or a scale-down is in flight.
It starts again and carries on from what the API holds, since its hysteresis lives in the
job's status: no decision is taken twice, no worker pod is created twice, no step is lost or
trained twice, and the job ends with a static run's bits.

Demand is a non-elastic pod asking for two of the four GPUs whenever the job holds all four,
gone after 3 s, so the job shrinks and grows back all along. :func:`lose_the_operator` runs it
and returns what it saw; ``tests/e2e/test_operator_loss.py`` runs a few kills in ``make test``
and checks them (:func:`check`), ``bench/operator_loss.py`` twenty or more.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Pod

from tests.e2e.test_drain_deadline import NAMESPACE, _running, _static, _tiny, _until
from tests.integration.agents import differing_bits
from tidal_agent.link import ElasticTrainingJobResource as ETJ
from tidal_api import keys
from tidal_local.arrivals import batch_pod

GPUS = 4


def steps_for(kills: int) -> int:
    """The job's length: the kills' time and then some. A kill aimed at the next scale comes
    every 13 steps or so here (twenty were done by step 265 in bench/operator_loss.py's run),
    after 20 steps to start. Two kills make the 100 steps of test_drain_deadline's jobs,
    whose static run (same model, training and workers) then serves this check too."""
    return 60 + 20 * kills


class Sampler:
    """The job's status and its worker pods, read every 0.1 s in a thread of its own: every
    target seen (by generation) and every worker pod seen (by uid: a released pod's name is
    given again by a later grow), with its name and the generation it was created for."""

    def __init__(self, kubeconfig: Path) -> None:
        self.api = Client(KubeConfig.from_file(kubeconfig).get())
        self.targets: dict[int, list[dict]] = defaultdict(list)
        self.pods: dict[str, tuple[str, int]] = {}  # uid -> (name, generation created for)
        self.status: dict = {}
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                status = dict(self.api.get(ETJ, "tiny", namespace=NAMESPACE)).get("status") or {}
                pods = self.api.list(Pod, namespace=NAMESPACE,
                                     labels={keys.JOB_LABEL: "tiny", keys.ROLE_LABEL: "worker"})
            except Exception as err:  # noqa: BLE001 - counted in the summary
                self.errors.append(err)
                continue
            self.status = status
            if (target := status.get("target")) and target not in self.targets[
                    target["generation"]]:
                self.targets[target["generation"]].append(target)
            for pod in pods:
                labels = pod.metadata.labels or {}
                self.pods.setdefault(pod.metadata.uid, (pod.metadata.name,
                                                        int(labels[keys.GENERATION_LABEL])))

    def in_flight(self, after: int = -1) -> bool:
        """A scale-up or a scale-down under way: a target not applied yet (for a generation
        past ``after``)."""
        target = self.status.get("target") or {}
        return target.get("generation", 0) > max(self.status.get("generation", 0), after)

    def target_generation(self) -> int:
        return (self.status.get("target") or {}).get("generation", 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.api.close()


def lose_the_operator(workdir: Path, *, kills: int, seed: int = 0,
                      progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the job and kill the operator ``kills`` times, each at a random moment within
    0.3 s of a target written and not yet applied, each kill at a later target than the last;
    what the run saw (see :func:`check`)."""
    doc = _tiny(steps_for(kills), {"min": 2, "max": GPUS},
                scaling={"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                         "switchOverheadSeconds": 1},
                checkpoint={"snapshotEverySteps": 1})
    rng = random.Random(seed)
    began = time.monotonic()
    with _running(doc, workdir, gpus=GPUS) as (cluster, _, status):
        sampler = Sampler(cluster.kubeconfig)
        stop_demand = threading.Event()
        demand = threading.Thread(target=_demand, args=(cluster.kubeconfig, sampler, stop_demand),
                                  daemon=True)
        demand.start()
        in_flight: list[bool] = []
        aimed = 0  # the generation of the target the last kill aimed at
        try:
            _until(lambda: sampler.status.get("members"), 120, "generation 0", cluster)
            for kill in range(kills):
                _until(lambda: _operator_up(cluster.metrics_port), 60, "the operator", cluster)
                # Each kill at a target of its own: on a loaded machine the target the last
                # kill aimed at may still be in flight once the operator is back.
                _until(lambda: sampler.in_flight(after=aimed), 60,
                       "a new scale-up or scale-down", cluster)
                aimed = sampler.target_generation()
                time.sleep(rng.uniform(0.0, 0.3))
                in_flight.append(sampler.in_flight())
                if status().get("phase") == "Succeeded":
                    raise AssertionError(f"the job ended before kill {kill + 1} of {kills}")
                cluster.restart_operator()
                progress(f"kill {kill + 1}/{kills} at step {sampler.status.get('step', 0)}, "
                         f"generation {sampler.status.get('generation')}, "
                         f"{'a target in flight' if in_flight[-1] else 'the target applied'}")
        finally:
            stop_demand.set()
            demand.join(30)
        _until(lambda: status().get("phase") == "Succeeded", 300, "the job to finish", cluster)
        sampler.stop()
        leader = status()["members"][0]
        report = json.loads(cluster.runtime.report_path(NAMESPACE, leader).read_text())
    return {"doc": doc, "report": report, "in_flight": in_flight,
            "targets": dict(sampler.targets), "pods": sampler.pods,
            "api_errors": len(sampler.errors), "wall_s": time.monotonic() - began}


def check(seen: dict[str, Any], kills: int) -> dict[str, Any]:
    """What must hold, as a summary whose ``ok`` says whether it does: the kills, half of
    them at least with a scale in flight; a grow and a shrink at least; one target per
    generation; each worker pod created once,
    for the generation whose target joins it; the job's steps and parameters a static
    run's."""
    targets, in_flight = seen["targets"], seen["in_flight"]
    duplicates = {g: t for g, t in targets.items() if len(t) > 1}
    created = Counter(seen["pods"].values())  # (name, generation) -> pods created so
    twice = sorted(f"{name} for generation {g}" for (name, g), n in created.items() if n > 1)
    stray = sorted(f"{name} for generation {g}" for name, g in created
                   if g in targets and len(targets[g]) == 1
                   and name not in targets[g][0].get("join", ()))
    doc = seen["doc"]
    differs = differing_bits(seen["report"], _static(doc, 2), doc["spec"]["training"]["steps"])
    summary = {
        "kills": len(in_flight), "with_a_scale_in_flight": sum(in_flight),
        "generations": len(targets), "duplicate_targets": duplicates, "stray_pods": stray,
        "pods_created_twice": twice, "worker_pods": len(seen["pods"]),
        "api_errors": seen["api_errors"],
        "bitwise_equal": differs is None, "differs": differs, "wall_s": round(seen["wall_s"], 1),
    }
    summary["ok"] = (len(in_flight) == kills and sum(in_flight) >= kills // 2
                     and len(targets) >= 3 and not duplicates and not stray and not twice
                     and differs is None)
    return summary


def _operator_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1):
            return True
    except OSError:
        return False


def _demand(kubeconfig: Path, sampler: Sampler, stop: threading.Event) -> None:
    """A non-elastic pod for two GPUs, for 3 s, whenever the job holds all four: the job
    shrinks for it, then grows back into its GPUs."""
    api = Client(KubeConfig.from_file(kubeconfig).get())
    count = 0
    try:
        while not stop.wait(0.2):
            if len(sampler.status.get("members", ())) == GPUS and not sampler.in_flight():
                count += 1
                api.create(Pod.from_dict(batch_pod(f"batch-{count}", NAMESPACE, gpus=2,
                                                   duration_s=3)))
                while not stop.is_set() and len(sampler.status.get("members", ())) == GPUS:
                    time.sleep(0.2)
    finally:
        api.close()

"""torchx components that launch a Tidal job (``torchx run -s local_cwd
tidal_cli.torchx_components:tidal --job_file JOB.yaml``).

Each component only builds the command line of one process; what trains is Tidal's own:

- :func:`tidal` runs ``tidal run JOB_FILE`` as one role with one replica, since ``tidal run``
  starts its worker processes itself (a torchx replica per worker would fight it for them);
- :func:`tidal_k8s` runs ``kubectl apply -f JOB_FILE``: on a cluster the ElasticTrainingJob is
  the workload, and the operator creates, grows and shrinks its pods. A fixed-size job of
  torchx's kubernetes scheduler would fight the operator instead, so the role is meant for a
  local scheduler, with kubectl's current context (``KUBECONFIG`` is passed on).

They are not registered under torchx's ``torchx.components`` entry points: a package that
registers any hides torchx's builtins (``dist.ddp``, ``utils.echo``...) in that environment.
torchx finds them by module instead. Needs the ``torchx`` extra (pyproject.toml says which).
"""

# No `from __future__ import annotations`: torchx reads the parameters' types off the signature
# and takes a string annotation for an unsupported type.
from pathlib import Path

import torchx.specs as specs

# The options the components set from their own parameters: given again among the passed-on
# arguments, the last would silently win.
_OWN_OPTIONS = ("-n", "--workers", "--steps", "--report")


def tidal(
    *tidal_args: str,
    job_file: str,
    workers: int = 0,
    steps: int = 0,
    report: str = "",
) -> specs.AppDef:
    """Trains an ElasticTrainingJob on this machine with `tidal run` (local_cwd scheduler).

    Args:
        tidal_args: further `tidal run` options, after `--` (e.g. -- --schedule gpipe)
        job_file: the ElasticTrainingJob manifest (YAML), relative to the working directory
        workers: worker processes; 0 for the job's spec.workers.min
        steps: steps to run; 0 for the job's spec.training.steps
        report: where `tidal run` writes its JSON report; empty for none
    """
    if not job_file:
        raise ValueError("--job_file is empty: name the ElasticTrainingJob manifest to train")
    # torchx passes Optional[int] on as a string, so 0 stands for the spec's own value.
    if workers < 0:
        raise ValueError(f"--workers must be at least 1, or 0 for spec.workers.min; got {workers}")
    if steps < 0:
        raise ValueError(f"--steps must be at least 1, or 0 for spec.training.steps; got {steps}")
    repeated = [a for a in tidal_args if a.split("=", 1)[0] in _OWN_OPTIONS]
    if repeated:
        raise ValueError(f"{', '.join(repeated)}: give it as the component's own option, "
                         "before `--`, not among the arguments passed on to `tidal run`")
    args = ["run", job_file]
    if workers:
        args += ["--workers", str(workers)]
    if steps:
        args += ["--steps", str(steps)]
    if report:
        args += ["--report", report]
    return specs.AppDef(
        name=_app_name(job_file),
        roles=[specs.Role(name="tidal", image=".", entrypoint="tidal",
                          args=[*args, *tidal_args], num_replicas=1)],
    )


def tidal_k8s(job_file: str, namespace: str = "") -> specs.AppDef:
    """Submits an ElasticTrainingJob to the cluster with `kubectl apply -f` (local_cwd scheduler).

    The operator runs the job from there: follow it with `kubectl get etj -w`.

    Args:
        job_file: the ElasticTrainingJob manifest (YAML); its spec.template.image is the agent image
        namespace: the namespace to create the job in; empty for the manifest's or the context's
    """
    if not job_file:
        raise ValueError("--job_file is empty: name the ElasticTrainingJob manifest to submit")
    args = ["apply", "-f", job_file]
    if namespace:
        args += ["--namespace", namespace]
    return specs.AppDef(
        name=_app_name(job_file),
        roles=[specs.Role(name="kubectl", image=".", entrypoint="kubectl", args=args,
                          num_replicas=1)],
    )


def _app_name(job_file: str) -> str:
    """The torchx app's name: the manifest's file name without its suffix (``tiny``)."""
    return Path(job_file).stem or "tidal"

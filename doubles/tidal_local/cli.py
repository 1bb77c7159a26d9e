"""``tidal local up`` and ``tidal local demo``: the one-machine cluster from the command line.

The group lives here, beside the cluster it drives, and the ``tidal`` command (``tidal_cli``)
mounts it next to the agent's commands. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import click
from rich.console import Console

_console = Console(stderr=True)


def _sigterm_as_interrupt() -> None:
    """SIGTERM takes the Ctrl-C path, so that either stops everything that was started.

    SIGINT gets Python's own handler even where it came ignored: a shell without job control
    starts background commands with SIGINT ignored, and their children inherit that, so Ctrl-C
    (or ``kill -INT``) would not stop a cluster started from a script's background job.
    """
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _logging(log_file: Path) -> None:
    """The cluster's own log goes to a file: the terminal belongs to the live view."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=log_file, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _cluster_options(f):
    options = [
        click.option("--nodes", type=click.IntRange(min=1), default=2, show_default=True,
                     help="Virtual GPU nodes."),
        click.option("--gpus-per-node", type=click.IntRange(min=1), default=4, show_default=True,
                     help="GPU slots per node."),
        click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
                     help="Port of the Kubernetes API (0: any free port)."),
        click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
                     help="Write the kubeconfig here (default: WORKDIR/kubeconfig)."),
        click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
                     default=Path("runs/local"), show_default=True,
                     help="Logs of every pod and the operator, the leaders' reports."),
        click.option("--arrival-rate", "rate_per_hour", type=click.FloatRange(min=0),
                     help="Non-elastic GPU jobs per hour (Poisson arrivals)."),
        click.option("--duration", "mean_duration_s", type=click.FloatRange(min=0.1),
                     help="Mean seconds a non-elastic job holds its GPUs (exponential)."),
        click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Draw durations and GPU counts from this trace CSV instead, e.g. "
                          "traces/elasticflow-itp/cluster01.csv."),
        click.option("--time-scale", type=click.FloatRange(min=1), default=400.0,
                     show_default=True, help="Trace seconds per second here."),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Seed of the arrivals."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _arrivals(defaults, rate_per_hour, mean_duration_s, trace, time_scale, seed, gpus_per_node,
              **extra):
    from dataclasses import replace

    changes = {"trace": trace, "time_scale": time_scale, "seed": seed,
               "max_gpus": gpus_per_node, **extra}
    if rate_per_hour is not None:
        changes["rate_per_hour"] = rate_per_hour
    if mean_duration_s is not None:
        changes["mean_duration_s"] = mean_duration_s
    return replace(defaults, **changes)


@click.group()
def local() -> None:
    """The whole system on this machine: API, GPU nodes, operator, agents, other GPU jobs."""


@local.command()
@_cluster_options
@click.option("--live/--no-live", default=None,
              help="The live view (default: when stderr is a terminal).")
def up(nodes, gpus_per_node, port, kubeconfig, workdir, rate_per_hour, mean_duration_s, trace,
       time_scale, seed, live) -> None:
    """Serve a one-machine Kubernetes cluster until Ctrl-C.

    A Kubernetes API on localhost (kubectl and helm work against it: export the KUBECONFIG it
    prints), NODES nodes with GPU slots, a scheduler, a kubelet that runs each worker pod as a
    `tidal agent` process and lets other pods hold their GPUs for their duration, the real
    tidal-operator, and Poisson arrivals of non-elastic GPU jobs. Apply an ElasticTrainingJob
    with kubectl to see it scale. Ctrl-C or SIGTERM stops every process it started.
    """
    from tidal_local.arrivals import ArrivalConfig
    from tidal_local.cluster import ClusterConfig, ClusterError, LocalCluster
    from tidal_local.processes import stop_fork_server

    _sigterm_as_interrupt()
    _logging(workdir / "cluster.log")
    arrivals = _arrivals(ArrivalConfig(rate_per_hour=30.0), rate_per_hour, mean_duration_s,
                         trace, time_scale, seed, gpus_per_node)
    config = ClusterConfig(workdir=workdir, nodes=nodes, gpus_per_node=gpus_per_node, port=port,
                           kubeconfig=kubeconfig, arrivals=arrivals)
    cluster = LocalCluster(config)
    try:
        cluster.start()
        click.echo(f"export KUBECONFIG={cluster.kubeconfig.resolve()}")
        _console.print(f"API {cluster.url}, {nodes} nodes x {gpus_per_node} GPUs, operator "
                       f"metrics on :{cluster.metrics_port}, logs in {workdir}; "
                       "Ctrl-C stops everything")
        sys.stdout.flush()
        show = _console.is_terminal if live is None else live
        _serve(cluster, show)
    except KeyboardInterrupt:
        _console.print("stopping: every pod's process, the operator, the API")
    except ClusterError as err:
        raise click.ClickException(str(err)) from None
    finally:
        cluster.stop()
        stop_fork_server()


def _serve(cluster, show: bool) -> None:
    """Until interrupted: watch the cluster's parts, and draw the live view if ``show``."""
    from rich.live import Live

    from tidal_local.observe import observe, render

    with Live(console=_console, refresh_per_second=2) if show else nullcontext() as screen:
        while True:
            cluster.check()
            if show:
                screen.update(render(observe(cluster.url, cluster.started_at)))
            time.sleep(1.0)


@local.command()
@click.option("--minutes", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="How long the job trains (its steps are set to fit).")
@click.option("--steps", type=click.IntRange(min=10),
              help="The job's steps (default: from --minutes).")
@click.option("--job", "job_file", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("examples/demo.yaml"), show_default=True, help="The ElasticTrainingJob.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("runs/demo.json"), show_default=True, help="The JSON report.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="The PNG plot (default: the report's path with .png).")
@click.option("--burst-after", "burst_after_s", type=click.FloatRange(min=0), default=15.0,
              show_default=True,
              help="Seconds after the first scale-up when one GPU job more than fits arrives.")
@_cluster_options
@click.option("--live/--no-live", default=None,
              help="The live view (default: when stderr is a terminal).")
def demo(minutes, steps, job_file, report, plot, burst_after_s, nodes, gpus_per_node, port,
         kubeconfig, workdir, rate_per_hour, mean_duration_s, trace, time_scale, seed,
         live) -> None:
    """Run an elastic job on the one-machine cluster for a few minutes.

    The cluster comes up, `kubectl apply -f` starts the job, the operator grows it into idle
    GPU slots and shrinks it when non-elastic jobs arrive. A live view shows it; at the end a
    summary, a PNG plot, and a check that the losses are bitwise those of a static run.
    """
    from tidal_local.binaries import BinaryError
    from tidal_local.cluster import ClusterError
    from tidal_local.demo import DemoConfig, DemoError, run_demo
    from tidal_local.processes import stop_fork_server

    _sigterm_as_interrupt()
    _logging(workdir / "cluster.log")
    defaults = DemoConfig().arrivals
    config = DemoConfig(
        minutes=minutes, job_file=job_file, steps=steps, report=report, plot=plot,
        workdir=workdir, nodes=nodes, gpus_per_node=gpus_per_node, port=port,
        kubeconfig=kubeconfig, live=live,
        arrivals=_arrivals(defaults, rate_per_hour, mean_duration_s, trace, time_scale, seed,
                           gpus_per_node, burst_after_scale_up_s=burst_after_s))
    try:
        result = run_demo(config, _console)
    except KeyboardInterrupt:
        _console.print("interrupted: everything the demo started has stopped")
        sys.exit(130)
    except (DemoError, ClusterError, BinaryError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    finally:
        stop_fork_server()
    if not result["finished"]:
        raise click.ClickException(f"the job did not finish within the time; see {workdir}/logs")

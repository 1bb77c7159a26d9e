"""``tidal-operator``: run Tidal's scaling controller against a Kubernetes API."""

from __future__ import annotations

import logging
import os

import click
import kopf

from tidal_operator import handlers
from tidal_operator.controller import Config


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False),
              help="Kubeconfig file; default $KUBECONFIG, ~/.kube/config or in-cluster.")
@click.option("--namespace", "-n", "namespaces", multiple=True,
              help="Watch ElasticTrainingJobs in these namespaces (default: all).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between control rounds.")
@click.option("--gpu-resource", default="nvidia.com/gpu", show_default=True,
              help="Extended resource that counts GPUs on nodes and pods.")
@click.option("--worker-lost-after", type=click.FloatRange(min=1.0), default=5.0,
              show_default=True,
              help="Set in every worker pod: tidal agent --lost-after, the seconds of "
                   "heartbeat silence after which a hung member counts as lost (a member that "
                   "dies is lost at once, from its ended connection).")
@click.option("--kueue/--no-kueue", default=True, show_default=True,
              help="Count Kueue Workloads waiting for admission as pending GPU demand (where "
                   "the Workload CRD exists, now or later).")
@click.option("--volcano/--no-volcano", default=True, show_default=True,
              help="Count Volcano PodGroups Pending or Inqueue as pending GPU demand (where "
                   "the PodGroup CRD exists, now or later).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port.")
@click.option("--liveness", default=None, metavar="URL",
              help="kopf's health endpoint, e.g. http://0.0.0.0:8080/healthz.")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging.")
def main(kubeconfig: str | None, namespaces: tuple[str, ...], interval: float, gpu_resource: str,
         worker_lost_after: float, kueue: bool, volcano: bool, metrics_port: int | None,
         liveness: str | None, verbose: bool) -> None:
    """Run the operator until interrupted (one replica: it runs standalone, without peering)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.DEBUG if verbose else logging.WARNING)
    if kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(kubeconfig)  # kopf's own login reads it
    config = Config(gpu_resource=gpu_resource, interval_s=interval,
                    worker_lost_after_s=worker_lost_after, kueue=kueue, volcano=volcano)
    handlers.watch_queues(config)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
        memo=handlers.memo_for(config, kubeconfig=kubeconfig, metrics_port=metrics_port),
    )


if __name__ == "__main__":
    main()

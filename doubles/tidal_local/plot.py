"""The demo's PNG: the cluster's GPUs, idle GPUs and pending GPU demand, the job's workers, and
its loss, over time, with every scale decision marked (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_COLORS = {"ScaleUp": "tab:green", "ScaleDown": "tab:red"}


def write_plot(path: Path, timeline: Sequence[dict[str, Any]], job: str,
               decisions: Sequence[dict[str, Any]]) -> Path:
    """``timeline``: samples of :meth:`ClusterView.sample`; ``decisions``: ``{"t", "reason"}``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    t = [s["t"] for s in timeline]
    runs = [s["jobs"].get(job) or {} for s in timeline]
    fig, (top, bottom) = pyplot.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                         height_ratios=(3, 2), layout="constrained")
    top.step(t, [s["gpus"] for s in timeline], where="post", color="black", label="GPUs")
    top.step(t, [s["idle_gpus"] for s in timeline], where="post", color="tab:gray",
             label="idle GPUs")
    top.step(t, [r.get("workers") or 0 for r in runs], where="post", color="tab:blue",
             linewidth=2.5, label=f"{job}: workers")
    top.step(t, [s["pending_gpus"] for s in timeline], where="post", color="tab:orange",
             linestyle="--", label="pending GPU demand")
    top.set_ylabel("GPUs")
    top.set_ylim(bottom=0)
    top.set_title(f"tidal local demo: {job} grows into idle GPUs and gives them back")
    loss = [(x, r["loss"]) for x, r in zip(t, runs, strict=True) if r.get("loss") is not None]
    if loss:
        bottom.plot(*zip(*loss, strict=True), color="tab:purple", label=f"{job}: loss")
    bottom.set_ylabel("loss (status.loss)")
    bottom.set_xlabel("seconds since the cluster started")
    for axes in (top, bottom):
        seen = set()
        for decision in decisions:
            reason = decision["reason"]
            axes.axvline(decision["t"], color=_COLORS.get(reason, "black"), alpha=0.5,
                         linestyle=":", label=reason if reason not in seen else None)
            seen.add(reason)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return path

"""The simulator's figures as PNGs: what each policy buys elastic jobs and costs the others.

- ``normalised.png``: mean elastic JCT and mean non-elastic queue time per policy, each over
  static's (static is 1; lower is better);
- ``queue_cdf.png``: the distribution of non-elastic queue times per policy;
- ``gpus.png``: GPUs allocated and idle over the trace, one panel per policy;
- ``tradeoff.png`` (:func:`write_tradeoff`): tidal's geometric-mean JCT speedup against its
  worst queue ratio over the traces, one point per threshold.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tidal_sim.compare import Outcome  # noqa: E402

_DAY = 86400.0


def write_plots(runs: dict[str, Outcome], gpus: int, out_dir: Path, title: str) -> list[Path]:
    """Write the three PNGs for ``runs`` (static among them) into ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(runs)
    paths = [out_dir / "normalised.png", out_dir / "queue_cdf.png", out_dir / "gpus.png"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
    jct = [1 / runs[n].report["jct_speedup"] for n in names]
    queue = [runs[n].report["queue_ratio"] for n in names]
    for ax, values, label in ((left, jct, "mean elastic JCT / static"),
                              (right, queue, "mean non-elastic queue time / static")):
        shown = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(names, shown, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, labels=[f"{v:.2f}" if v is not None else "n/a" for v in values])
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    fig.suptitle(f"{title}: normalised to static (lower is better)")
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for i, name in enumerate(names):
        times = [t / 60 for t in runs[name].queue_s]
        if times:
            share = [(k + 1) / len(times) for k in range(len(times))]
            ax.step(times, share, where="post", label=name, color=f"C{i}")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("non-elastic queue time (minutes)")
    ax.set_ylabel("fraction of jobs")
    ax.set_ylim(0, 1.01)
    ax.legend(loc="lower right")
    ax.set_title(f"{title}: queue-time CDF")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.9 * len(names)), sharex=True,
                             sharey=True, layout="constrained", squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        times, held = runs[name].timeline
        days = [t / _DAY for t in times]
        ax.fill_between(days, held, step="post", color="C0", alpha=0.8, linewidth=0,
                        label="allocated")
        ax.fill_between(days, held, [gpus] * len(held), step="post", color="C1", alpha=0.3,
                        linewidth=0, label="idle")
        ax.set_ylabel(f"{name}\nGPUs")
        ax.set_ylim(0, gpus)
    axes[0, 0].legend(loc="upper right", ncols=2)
    axes[-1, 0].set_xlabel("days since the first submission")
    fig.suptitle(f"{title}: GPUs allocated and idle")
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths


def write_tradeoff(curves: dict[str, list[dict]], path: Path) -> Path:
    """``curves``: per kind of table, bench/sim.py's trade-off summary (threshold, geometric
    mean JCT speedup, worst queue ratio, in threshold order); one line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for i, (kind, points) in enumerate(curves.items()):
        shown = [p for p in points if p["queue_ratio_worst"] is not None]
        xs = [p["queue_ratio_worst"] for p in shown]
        ys = [p["jct_speedup_geomean"] for p in shown]
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=kind)
        for p, x, y in zip(shown, xs, ys, strict=True):
            ax.annotate(f"{p['threshold']:g}", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("worst non-elastic queue ratio over the traces (static = 1)")
    ax.set_ylabel("geometric-mean elastic JCT speedup")
    ax.legend(title="scale tables")
    ax.set_title("tidal over the threshold: elastic JCT against queue")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

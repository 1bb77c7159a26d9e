"""The elastic jobs' scale tables: FlexTrain's, and each job's curve over its own minimum.

:mod:`tidal_sim.engine` loads one table per FlexTrain size (``load_tables``) for the run's
kind of tables (PP-only or DP+PP) and gives each elastic job its curve (``job_table``), which
``decide`` reads as the job's scale table and the engine as its speedup.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tidal_api import ScaleTable
from tidal_api.scale import ScaleRow
from tidal_sim.trace import GPUS_PER_NODE

if TYPE_CHECKING:
    from tidal_sim.config import SimConfig

TABLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "scale-tables"


def load_tables(config: SimConfig) -> dict[str, ScaleTable]:
    """FlexTrain's table of each size, of the run's kind (``config.elastic``)."""
    return {size: ScaleTable.model_validate_json(
        (config.tables_dir / f"flextrain-{size}-{config.elastic}.json").read_text())
        for size in ("small", "medium", "large")}


def job_table(table: ScaleTable, request: int, lowest: int | None = None) -> ScaleTable:
    """``table``'s speedup curve over a job that asks for ``request`` 8-GPU workers.

    The curve is a function of the scale factor (workers over the request), from 1 to the
    table's ``max_workers / min_workers``: at ``w`` workers the job runs at the speedup of the
    table's largest row whose factor is at most ``w / request`` (conservative: never more
    than the table shows for that many GPUs per requested GPU). A job that may start below
    its request (``lowest``) runs at ``w / request`` there: linear, a lower bound of the
    tables' concave curves. Rows that gain nothing over a smaller count are left out;
    tokens/s is the speedup, a step's seconds the table's first row's over it. Built
    unvalidated: ``decide`` reads only rows' workers, tokens/s and step seconds.
    """
    low = table.min_workers
    cap = request * table.max_workers // low
    base = table.rows[0].step_seconds
    rows, top = [], 0.0
    for w in range(lowest or request, cap + 1):
        # factor r.workers / low <= w / request, in integers
        speedup = w / request if w < request else max(
            r.speedup for r in table.rows if r.workers * request <= w * low)
        if speedup > top:
            top = speedup
            rows.append(ScaleRow.model_construct(workers=w, tokens_per_second=speedup,
                                                 speedup=speedup, step_seconds=base / speedup))
    return ScaleTable.model_construct(job=table.job, min_workers=lowest or request,
                                      max_workers=rows[-1].workers,
                                      gpus_per_worker=GPUS_PER_NODE, rows=tuple(rows))

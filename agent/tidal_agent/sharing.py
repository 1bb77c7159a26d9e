"""What time-shared cores cost a pipeline beyond processor sharing: the host's sharing probe.

The dry run shares a host's cores among the ranks that compute at once (processor sharing):
``n`` ranks on ``c`` cores each run at ``c / n`` of their speed. A pipeline whose ranks
outnumber the cores pays more than that. Traced on this project's 2-core host (width-128
job, ``/proc/<pid>/task/*/stat`` between steps): from 2 ranks to 4 the step's CPU seconds grew
by a quarter (the blocks' own by a tenth, the transport's threads from 9 to 54 ms per step)
and the cores still idled a fifth of the step, where the dry run fills them: every message
wakes two threads, each on a core another rank holds, with a cache full of that rank's
tensors. A probe that only computes (two processes per core against one, without messages)
measured 7-11% where the 4-rank layouts were predicted 20% short.

So the probe runs the pipeline itself: ``copies`` copies of the profiled run, at once, on the
same cores (enough for two ranks per core), for a few steps each. Their median step against
the dry run of the same copies (replicas sharing the cores, as data-parallel pipelines do,
without the all-reduce) is what a step on time-shared cores costs beyond processor sharing;
``tidal_plan.profiled`` reads it as ``Profile.sharing`` and slows the layouts whose ranks
outnumber the cores by it. Where the profiled layout alone has more ranks than cores the
profile's own steps saw the sharing and there is no probe.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

STEPS = 8  # timed steps of each copy
WARMUP = 2  # untimed steps of each copy: caches, allocations, the optimizer's state


def sharing_copies(world_size: int, threads: int = 1, cores: int | None = None) -> int:
    """Copies of a ``world_size``-rank run that put two ranks on each core; 0 for no probe.

    No probe where one run already has more ranks than the cores hold (``cores // threads``).
    """
    at_once = max(1, (cores or os.cpu_count() or 1) // threads)
    if world_size > at_once:
        return 0
    return -(-2 * at_once // world_size)  # ceil


def measure_sharing(train: Callable[[], list[float]], copies: int) -> dict[str, Any]:
    """Run ``train`` (one copy: its timed step seconds) ``copies`` times at once.

    Returns ``{"copies", "steps", "step_s"}``: the timed steps of each copy and their median
    over all copies. Raises the first copy's error, once every copy has ended.
    """
    results: list[list[float] | None] = [None] * copies
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            results[index] = train()
        except BaseException as err:  # noqa: BLE001 -- re-raised below, in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,), name=f"tidal-sharing-{i}")
               for i in range(copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"the sharing probe failed: {errors[0]}") from errors[0]
    steps = [seconds for copy in results if copy for seconds in copy]
    if not steps:
        raise RuntimeError("the sharing probe timed no step")
    return {"copies": copies, "steps": results, "step_s": statistics.median(steps)}

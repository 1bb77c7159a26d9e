"""Lower bounds on a pipeline step, cheap enough to order the search's candidates by.

``makespan_lower_bound`` holds for any order of a step's actions; ``estimate_lower_bound``
tightens it with the order each schedule fixes and bounds each rank's peak activation bytes.
The search prices candidates in the order of these bounds and stops once a bound exceeds the
best step found (branch and bound), so a bound must never exceed ``estimate_step``'s figures.
"""

from __future__ import annotations

import itertools

from tidal_api.layout import Layout, ScheduleKind
from tidal_plan.actioncosts import Costs, per_stage
from tidal_plan.estimate import extrapolation_start


def makespan_lower_bound(layout: Layout, costs: Costs) -> float:
    """A bound no step of ``layout`` under ``costs`` beats, in microseconds of Python.

    Pipeline rank ``r`` cannot start before micro-batch 0 has crossed the ``r`` stages before
    it, then computes ``m`` micro-batches on each of its stages; its last backward (stage
    ``r``, last micro-batch; with a split backward, its last I) still has to cross those stages
    back. It holds for any order of the actions; ``estimate_lower_bound`` tightens it with the
    order each schedule fixes, and the search prices candidates in the order of that bound.
    """
    stages = layout.num_stages
    f = per_stage(costs.forward, stages)
    i = per_stage(costs.input_grad, stages)
    w = per_stage(costs.weight_grad, stages)
    split = layout.schedule is ScheduleKind.ZERO_BUBBLE
    pp, m, comm = layout.pp, layout.num_micro_batches, costs.comm
    work = [x + y + z for x, y, z in zip(f, i, w, strict=True)]  # of a micro-batch, per stage
    forward_and_input = [x + y for x, y in zip(f, i, strict=True)]
    bound = head = tail = input_tail = 0.0
    for rank in range(pp):
        busy = m * sum(work[rank::pp])
        if split:  # W may trail the last I, but every F and I comes before it
            critical = m * sum(forward_and_input[rank::pp]) + input_tail
            bound = max(bound, head + busy, head + critical)
        else:
            bound = max(bound, head + busy + tail)
        head += f[rank] + comm
        tail += i[rank] + w[rank] + comm
        input_tail += i[rank] + comm
    return bound


def estimate_lower_bound(layout: Layout, costs: Costs) -> tuple[float, tuple[float, ...]]:
    """Bounds on ``estimate_step``'s makespan and on each rank's peak activation bytes.

    Where the step is simulated whole, the schedule's order tightens ``makespan_lower_bound``:
    it fixes how many forwards ``k`` a rank runs before its first backward (GPipe all ``m``,
    1F1B ``pp - r``: its warm-up and one more; ZB-H1 at most ``pp - r`` by its in-flight
    limit, and exactly that many). That backward, of micro-batch 0, waits for micro-batch 0
    to reach the last stage and its gradient to come back; then the rank still owes its other
    ``m - k`` forwards and every backward, and the last backward's gradient still has to cross
    the ranks before it (with ZB-H1, the last I's does, after every W its order puts before
    that I: all but the ``min(r, m - k)`` it leaves for the end). GPipe is a flow shop twice
    over: the slowest stage's forwards, then its backwards, each stretched by one pass of a
    micro-batch through the other stages. Until its first backward frees anything, a rank
    holds its first ``k`` forwards' activations.

    An extrapolated estimate can sit a little off the dry run, so a long step gets only the
    generic bounds: ``makespan_lower_bound`` and one micro-batch's activations.
    """
    pp, m, stages, comm = layout.pp, layout.num_micro_batches, layout.num_stages, costs.comm
    act = per_stage(costs.activation_bytes, stages)
    bound = makespan_lower_bound(layout, costs)
    one = tuple(max(act[rank::pp]) for rank in range(pp))
    if extrapolation_start(layout) is not None:
        return bound, one
    kind, last = layout.schedule, pp - 1
    f = per_stage(costs.forward, stages)
    i = per_stage(costs.input_grad, stages)
    w = per_stage(costs.weight_grad, stages)
    b = [x + y for x, y in zip(i, w, strict=True)]
    if kind is ScheduleKind.INTERLEAVED:
        return _interleaved_bound(layout, bound, one, f, b, act, comm if pp > 1 else 0.0)
    if kind is ScheduleKind.GPIPE:
        flow = sum(f) + sum(b) + 2 * last * comm + (m - 1) * (max(f) + max(b))
        return max(bound, flow), tuple(max(g, m * a) for g, a in zip(one, act, strict=True))
    bound = _one_f_one_b_bound(layout, bound, f, i, w, comm)
    held = tuple(max(g, min(m, pp - r) * act[r]) for r, g in enumerate(one))
    return bound, held


def _one_f_one_b_bound(
    layout: Layout, bound: float, f: list[float], i: list[float], w: list[float], comm: float,
) -> float:
    """``estimate_lower_bound``'s makespan for 1F1B or ZB-H1 (see there)."""
    pp, m, last = layout.pp, layout.num_micro_batches, layout.pp - 1
    split = layout.schedule is ScheduleKind.ZERO_BUBBLE
    back_of = i if split else [x + y for x, y in zip(i, w, strict=True)]  # I, or a whole B
    # The way a gradient goes from rank r to rank 0: up[r], summed in rank order.
    up = list(itertools.accumulate((x + comm for x in back_of), initial=0.0))
    forward = sum(f) + last * comm  # micro-batch 0 reaches the last stage
    back = 0.0  # and its gradient comes back to rank r
    for rank in range(last, -1, -1):
        k = min(m, pp - rank)  # forwards before the first backward
        owed = (m - k) * f[rank]
        start = forward + back
        if split:  # every W; or every I, the W before the last I, then rank 0's last W
            late = min(rank, m - k)
            bound = max(bound, start + owed + m * (i[rank] + w[rank]),
                        start + owed + m * i[rank] + (m - late - 1) * w[rank] + up[rank] + w[0])
        else:
            bound = max(bound, start + owed + m * back_of[rank] + up[rank])
        back += back_of[rank] + comm
    return bound


def _interleaved_bound(
    layout: Layout,
    bound: float,
    one: tuple[float, ...],
    f: list[float],
    b: list[float],
    act: list[float],
    comm: float,
) -> tuple[float, tuple[float, ...]]:
    """``estimate_lower_bound`` of an interleaved step simulated whole.

    Rank ``r`` runs its warm-up forwards and one more (the ``k``-th on chunk ``(k // pp) % v``)
    before its first backward: micro-batch 0 on its last chunk, once micro-batch 0 has gone
    through every stage and its gradient has come back. Its last backward is micro-batch
    ``m - 1`` on chunk 0, whose gradient still crosses the ranks before it.
    """
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_micro_batches
    stages = pp * v
    forward = sum(f) + (stages - 1) * comm
    held = []
    for rank, generic in enumerate(one):
        chunks = [c * pp + rank for c in range(v)]
        first = min(m * v, (v - 1) * pp + 2 * (pp - rank - 1) + 1)  # forwards before it
        cycles, rest = divmod(first, pp * v)
        done = [cycles * pp + min(pp, max(0, rest - c * pp)) for c in range(v)]
        start = forward + sum(b[s] + comm for s in range(chunks[-1] + 1, stages))
        owed = sum((m - n) * f[s] for n, s in zip(done, chunks, strict=True))
        backwards = m * sum(b[s] for s in chunks)
        bound = max(bound, start + owed + backwards + sum(b[s] + comm for s in range(rank)))
        held.append(max(generic, sum(n * act[s] for n, s in zip(done, chunks, strict=True))))
    return bound, tuple(held)

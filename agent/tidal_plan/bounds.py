"""Lower bounds on a pipeline step, cheap enough to order the search's candidates by.

``makespan_lower_bound`` holds for any order of a step's actions; ``estimate_lower_bound``
tightens it with the order each schedule fixes and bounds each rank's peak activation bytes.
The search prices candidates in the order of these bounds and stops once a bound exceeds the
best step found (branch and bound), so a bound must never exceed ``estimate_step``'s figures.
"""

from __future__ import annotations

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
    m, comm = layout.num_micro_batches, costs.comm
    bound = head = tail = input_tail = 0.0
    for rank in range(layout.pp):
        stages = layout.rank_stages(rank)
        busy = m * sum(f[s] + i[s] + w[s] for s in stages)
        if split:  # W may trail the last I, but every F and I comes before it
            critical = m * sum(f[s] + i[s] for s in stages) + input_tail
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
    the ranks before it (with ZB-H1, the last I's does, after at least ``m - pp`` of the
    rank's W: ZB-H1 holds at most ``pp`` micro-batches without their W, so its last forward
    waits for them). GPipe is a flow shop twice over: the slowest stage's forwards, then its
    backwards, each stretched by one pass of a micro-batch through the other stages. Until
    its first backward frees anything, a rank holds its first ``k`` forwards' activations.

    An extrapolated estimate can sit a little off the dry run, so a long step gets only the
    generic bounds: ``makespan_lower_bound`` and one micro-batch's activations.
    """
    pp, m, stages, comm = layout.pp, layout.num_micro_batches, layout.num_stages, costs.comm
    act = per_stage(costs.activation_bytes, stages)
    bound = makespan_lower_bound(layout, costs)
    one = tuple(max(act[s] for s in layout.rank_stages(rank)) for rank in range(pp))
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
    split = kind is ScheduleKind.ZERO_BUBBLE
    forward = sum(f) + last * comm  # micro-batch 0 reaches the last stage
    back = 0.0  # and its gradient comes back to rank r
    for rank in range(last, -1, -1):
        owed = (m - min(m, pp - rank)) * f[rank]
        start = forward + back
        if split:  # every W; or every I, the W before the last forward, then rank 0's last W
            inputs = sum(i[s] + comm for s in range(rank))
            bound = max(bound, start + owed + m * (i[rank] + w[rank]),
                        start + owed + m * i[rank] + max(0, m - pp) * w[rank] + inputs + w[0])
        else:
            bound = max(bound, start + owed + m * b[rank] + sum(b[s] + comm for s in range(rank)))
        back += (i if split else b)[rank] + comm
    held = tuple(max(g, min(m, pp - r) * act[r]) for r, g in enumerate(one))
    return bound, held


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

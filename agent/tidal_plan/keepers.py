"""The keeper rule of peer snapshots: which member of a world keeps whose copy.

At every step boundary each member of a world sends a copy of its training state to the next
member of the ring, its keeper (tidal_agent.snapshot), so that losing one worker, or several
none of whom keeps another's copy, loses no state. The same rule lets a shrink's leavers go at
its boundary: where every leaver's keeper stays, the keepers send the leavers' state from the
copies they hold. The agent applies it at a switch and the cluster simulator (tidal_sim) to
model when a shrink frees its GPUs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def keepers(members: Sequence[str]) -> dict[str, str]:
    """Each member's keeper: the next member of the ring, which holds its copy."""
    return {m: members[(i + 1) % len(members)] for i, m in enumerate(members)}


def keepers_stay(members: Sequence[str], leaving: Collection[str]) -> bool:
    """Whether every member in ``leaving`` has a keeper that stays: then the leavers may go
    at the boundary and their keepers send their state."""
    keeper = keepers(members)
    return not any(keeper[m] in leaving for m in members if m in leaving)

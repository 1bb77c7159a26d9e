"""A job as one control round sees it, and what this operator wrote that no watch shows yet.

Every decision reads the job's status as its watch delivered it (:class:`JobView`). A write
takes a moment to come back through the watch, so for a round or two the view may predate it:
:class:`Written` remembers what this process wrote, only so as not to act twice on one
decision meanwhile. Nothing in it is needed after a restart: the status it guards is there by
then (a new operator's first view comes from a fresh list).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal_api import ElasticTrainingJob, JobStatus
from tidal_api.status import Arrival


@dataclass(frozen=True, slots=True)
class JobView:
    """A parsed job of this round: its index key ("namespace/name"), its body as the watch
    delivered it, and its typed spec and status."""

    key: str
    body: Mapping[str, Any]
    job: ElasticTrainingJob
    status: JobStatus

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def namespace(self) -> str:
        return self.job.metadata.namespace or "default"

    @property
    def uid(self) -> str:
        return self.body["metadata"].get("uid", "")

    @property
    def generation(self) -> int:
        """metadata.generation: which spec the conditions describe."""
        return self.body["metadata"].get("generation", 0)


@dataclass(slots=True)
class Written:
    """Writes of this process that the watches may not have delivered yet, by job key."""

    targets: dict[str, int] = field(default_factory=dict)  # generation of the last target
    restarts: dict[str, tuple[str, int]] = field(default_factory=dict)  # (uid, status.restarts)
    started: dict[str, str] = field(default_factory=dict)  # uid given its first target
    # status.rendezvousMissingSince
    rendezvous_missing: dict[str, str | None] = field(default_factory=dict)
    arrivals: dict[str, tuple[Arrival, ...]] = field(default_factory=dict)  # status.arrivals
    services: set[str] = field(default_factory=set)  # uids whose Service exists

    def stale(self, view: JobView) -> bool:
        """Whether ``view`` predates a restart of the job that this operator wrote."""
        uid, restarts = self.restarts.get(view.key, ("", 0))
        return uid == view.uid and restarts > view.status.restarts

    def restarted(self, view: JobView, restarts: int) -> None:
        """The job restarts: its targets, first pods and rendezvous timer start afresh."""
        self.restarts[view.key] = (view.uid, restarts)
        for kept in (self.targets, self.rendezvous_missing, self.started):
            kept.pop(view.key, None)

    def forget(self, key: str) -> None:
        """A deleted job: one created again under its name starts afresh."""
        for kept in (self.targets, self.restarts, self.rendezvous_missing, self.started,
                     self.arrivals):
            kept.pop(key, None)

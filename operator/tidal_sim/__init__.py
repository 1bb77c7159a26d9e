"""Trace-driven cluster simulator (issue 8): the operator's ``decide`` over a simulated clock.

``trace`` loads a job trace and marks its elastic jobs by a stated rule; ``engine`` runs one
policy over it and returns a report dict. Nothing here imports torch, kopf or tidal_agent.
"""

from tidal_sim.config import POLICIES, SimConfig
from tidal_sim.engine import simulate
from tidal_sim.trace import TraceJob, default_nodes, load_trace, mark_elastic

__all__ = ["POLICIES", "SimConfig", "TraceJob", "default_nodes", "load_trace", "mark_elastic",
           "simulate"]

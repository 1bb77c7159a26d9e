"""The ``tidal`` command: the agent's commands and ``tidal local``, in one click group.

The commands live beside what they drive: ``run``, ``plan``, ``agent`` and ``data`` in
``tidal_agent.cli``, ``local`` (the one-machine cluster, which runs the operator and the agents
as processes) in ``tidal_operator.local.cli``, ``sim`` (the trace-driven simulator) in
``tidal_operator.sim.cli``. The import contracts keep tidal_agent and
tidal_operator apart, so neither may mount the other's commands; this package, which is
neither, does, and holds nothing else.
"""

from __future__ import annotations

import sys

import click

from tidal_agent.cli import main as _agent
from tidal_operator.local.cli import local
from tidal_operator.sim.cli import sim


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=_agent.help)
def main() -> None:
    pass


for _name, _command in _agent.commands.items():
    main.add_command(_command, _name)
main.add_command(local)
main.add_command(sim)

if __name__ == "__main__":
    sys.exit(main())

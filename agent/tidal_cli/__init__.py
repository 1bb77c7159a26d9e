"""The ``tidal`` command: the agent's commands, ``tidal sim`` and ``tidal local``, in one group.

The commands live beside what they drive: ``run``, ``plan``, ``agent`` and ``data`` in
``tidal_agent.cli``, ``rendezvous`` (a job's rendezvous pod) in ``tidal_agent.host``, ``sim``
(the trace-driven cluster simulator) in ``tidal_sim.cli``, ``local`` (the one-machine cluster,
which runs the operator and the agents as processes) in ``tidal_local.cli``. The import
contracts keep the agent, the operator and the doubles apart, so none may mount another's
commands; this package, which is none of them, does, and holds nothing
else but the torchx components that launch the command (``torchx_components``, imported by
torchx only, from the ``torchx`` extra). The images carry no doubles (the Dockerfile's build
leaves doubles/ out), so ``tidal local`` is mounted only where the one-machine cluster is
installed: a source checkout.
"""

from __future__ import annotations

import importlib.util
import sys

import click

from tidal_agent.cli import main as _agent
from tidal_agent.host import rendezvous
from tidal_sim.cli import sim


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=_agent.help)
def main() -> None:
    pass


for _name, _command in _agent.commands.items():
    main.add_command(_command, _name)
main.add_command(rendezvous)
main.add_command(sim)
if importlib.util.find_spec("tidal_local") is not None:
    from tidal_local.cli import local

    main.add_command(local)

if __name__ == "__main__":
    sys.exit(main())

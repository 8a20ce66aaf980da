"""Entry point of the dflash plugin (group `specdec`): the proposer, its training objective and `specdec export`."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .proposer import DFlashProposer

    register(DFlashProposer)


@specdec.hookimpl
def register_objectives(register):
    from .training import DFlashObjective

    register(DFlashObjective)


@specdec.hookimpl
def register_commands(cli):
    from .commands import export

    cli.add_command(export)

"""Entry point of the dflash plugin (group `specdec`): the dflash and dflash2 proposers, their training objectives
and `specdec export`."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .dflash2_proposer import DFlash2Proposer
    from .proposer import DFlashProposer

    register(DFlashProposer)
    register(DFlash2Proposer)


@specdec.hookimpl
def register_objectives(register):
    from .dflash2_training import DFlash2Objective
    from .training import DFlashObjective

    register(DFlashObjective)
    register(DFlash2Objective)


@specdec.hookimpl
def register_commands(cli):
    from .commands import export

    cli.add_command(export)

"""Entry point of the dflash plugin (group `specdec`): the proposer and its training objective."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .proposer import DFlashProposer

    register(DFlashProposer)


@specdec.hookimpl
def register_objectives(register):
    from .training import DFlashObjective

    register(DFlashObjective)

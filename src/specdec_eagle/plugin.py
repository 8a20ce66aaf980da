"""Entry point of the eagle3 plugin (group `specdec`): the proposer and its training objective."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .proposer import Eagle3Proposer

    register(Eagle3Proposer)


@specdec.hookimpl
def register_objectives(register):
    from .training import Eagle3Objective

    register(Eagle3Objective)

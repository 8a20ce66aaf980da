"""Entry point of the eagle3 plugin (group `specdec`): the proposer, its training objective and its exporter
(`specdec export`, the dflash plugin's command, writes EAGLE-3 drafts through it)."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .proposer import Eagle3Proposer

    register(Eagle3Proposer)


@specdec.hookimpl
def register_objectives(register):
    from .training import Eagle3Objective

    register(Eagle3Objective)


@specdec.hookimpl
def register_exporters(register):
    from .export import Eagle3Exporter

    register(Eagle3Exporter)

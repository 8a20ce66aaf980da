"""Entry point of the dflash plugin (group `specdec`)."""

import specdec


@specdec.hookimpl
def register_proposers(register):
    from .proposer import DFlashProposer

    register(DFlashProposer)

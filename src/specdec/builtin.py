"""The built-in plugin: specdec's own proposers, verifiers and caches, registered like any third party's."""

from __future__ import annotations

from .caches import DynamicKVCache
from .hookspecs import hookimpl
from .native_cache import NativeKVCache
from .proposers.autoregressive import AutoregressiveProposer
from .proposers.draft_model import DraftModelProposer
from .proposers.ngram import NgramProposer
from .verifiers import GreedyVerifier, RejectionSamplingVerifier


@hookimpl
def register_proposers(register):
    register(AutoregressiveProposer)
    register(NgramProposer)
    register(DraftModelProposer)


@hookimpl
def register_verifiers(register):
    register(GreedyVerifier)
    register(RejectionSamplingVerifier)


@hookimpl
def register_caches(register):
    register(DynamicKVCache)
    register(NativeKVCache)

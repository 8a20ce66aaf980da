"""specdec: lossless speculative decoding for Hugging Face causal LMs, with proposers as plugins."""

from .api import GenerationOutput, SpeculativeDecoder
from .contracts import DecodeState, Draft, KVCache, Proposer, ProposerConfig, Verdict, Verifier
from .engine import GenerationStats
from .errors import PluginError, SpecdecError
from .hookspecs import hookimpl
from .sampling import SamplingParams
from .target import TargetModel, TargetOutput

__version__ = "0.1.0"

__all__ = [
    "DecodeState", "Draft", "GenerationOutput", "GenerationStats", "KVCache", "PluginError", "Proposer",
    "ProposerConfig", "SamplingParams", "SpecdecError", "SpeculativeDecoder", "TargetModel", "TargetOutput",
    "Verdict", "Verifier", "hookimpl",
]

"""Sampling parameters and the one function that turns target logits into the distribution sampled from.

Plain and speculative decoding both go through `logits_to_probs`, so the distribution is the same by
construction; the verifier then makes speculative decoding sample from it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):  # inf would sample uniformly
            raise SpecdecError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}.")
        if self.top_k < 0:
            raise SpecdecError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecdecError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    Top-k keeps the k largest logits; top-p keeps the smallest set of the largest probabilities whose
    mass reaches p (the token that crosses p is kept). Both are applied after the temperature, as
    transformers does.
    """
    scores = logits.float() / max(params.temperature, 1e-5)
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)

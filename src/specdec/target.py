"""The target adapter: one transformers causal LM, its tokenizer, and the hidden-state taps proposers ask for.

How the model runs (its forward and KV cache) is a backend's job (`specdec.backends`): specdec's own forward
for Llama-family models (`specdec.native`: bit-identical logits, 15-25% less time per step for the embedded
target on a CPU, and about 20% less again with its bfloat16 weights prepacked for oneDNN, `specdec.prepacked`)
with the "native" cache, or transformers' forward with its DynamicCache. The "auto" cache picks the native one
whenever the model qualifies. Tap layer id L is the output of decoder layer L (transformers'
``hidden_states[L + 1]``).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .backends import TargetBackend, TransformersBackend, TreeParents, base_model, decoder_layers, make_backend
from .caches import DynamicKVCache
from .contracts import KVCache, TargetOutput, same_length
from .errors import SpecdecError

__all__ = ["TargetModel", "TargetOutput", "base_model", "decoder_layers"]


class ModelLock:
    """One model object's lock, shared by every TargetModel over it: a generation (or a taps-only forward)
    holds it throughout, since the KV cache, tap hooks and packed weights are reached through the model.

    Other threads wait their turn; the thread already holding it is refused with a sentence, since a
    generation started from inside another (a streaming callback calling generate) would reset the state
    the outer one is using."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    @contextmanager
    def hold(self, inside_ok: bool = False) -> Iterator[None]:
        """Wait for the lock and hold it. From the thread already holding it: go on when `inside_ok` (a
        taps-only forward, which leaves the generation's cache alone), else refuse."""
        if self._owner == threading.get_ident():
            if inside_ok:
                yield
                return
            raise SpecdecError("generate() was called from inside a generation on the same model (e.g. from an "
                               "on_text callback); start it after the running one returns, or on another model.")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None


_MODEL_LOCKS: weakref.WeakKeyDictionary[nn.Module, ModelLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> ModelLock:
    """The lock of one model object (see ModelLock), made on first use."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = ModelLock()
        return lock


class TargetModel:
    """Wraps a transformers causal LM for speculative decoding (prefill, k-token forward, rollback).

    `cache`: "auto", "native", "dynamic" or a registered KVCache class (see `specdec.backends.make_backend`).
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, cache: str | type[KVCache] = "auto") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self._layers = decoder_layers(model)
        self._cache_choice = cache
        self.lock = model_lock(model)  # held by a generation from prefill to its last step (Engine.generate)
        self.backend: TargetBackend = make_backend(model, cache)
        self._tap_ids: list[int] = []

    # -- what proposers may read -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31 - 1)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        return {int(i) for i in ids}

    # -- taps ----------------------------------------------------------------------------------------
    @property
    def tap_ids(self) -> list[int]:
        """The decoder layers whose outputs every forward captures (request_taps), in request order."""
        return list(self._tap_ids)

    def request_taps(self, layer_ids: Sequence[int]) -> None:
        """Capture the outputs of these decoder layers in every later forward (ids in [0, num_layers))."""
        for layer_id in layer_ids:
            if not 0 <= layer_id < self.num_layers:
                raise SpecdecError(f"Hidden-state tap at layer {layer_id} is outside the target's "
                                   f"{self.num_layers} decoder layers (valid ids: 0..{self.num_layers - 1}).")
            if layer_id in self._tap_ids:
                continue
            self._tap_ids.append(layer_id)
            self.backend.add_tap(layer_id)

    # -- cache and forwards -------------------------------------------------------------------------
    @property
    def cache_name(self) -> str:
        """The KV cache in use ("native" means specdec's own forward runs the model)."""
        return self.backend.cache_name

    def reset(self) -> None:
        self._recheck_backend()
        self.backend.reset()

    def _recheck_backend(self) -> None:
        # A hook (or replaced layer) added since this TargetModel was made would be skipped by the native
        # forward, silently changing the output; with cache="auto" the transformers forward takes over.
        # Run before each generation, and before each taps-only forward outside one (training): a walk over
        # the modules, well under 1 ms. A live cache cannot change hands, so mid-generation it is not run.
        reason = self.backend.coverage_problem()
        if reason is None:
            self.backend.refresh_weights()
            return
        if self._cache_choice != "auto":
            raise SpecdecError(f"The native cache needs specdec's own forward, which no longer covers this model "
                               f"({reason}, since the TargetModel was made); use cache='dynamic' or 'auto'.")
        self.backend = TransformersBackend(self.model, DynamicKVCache)
        for layer_id in self._tap_ids:  # the transformers forward taps with hooks
            self.backend.add_tap(layer_id)

    @property
    def cache_lengths(self) -> list[int]:
        """Positions the KV cache holds, per row ([] before the first forward)."""
        return self.backend.lengths()

    @property
    def cache_length(self) -> int:
        """Positions the KV cache holds (every row holds as many until batching lands)."""
        lengths = self.cache_lengths
        return same_length(lengths, "cache_length") if lengths else 0

    def _per_row(self, lengths: int | Sequence[int]) -> list[int]:
        try:  # one integer (a Python, NumPy or 0-d tensor int): the same length for every row
            return [operator.index(lengths)] * max(1, len(self.cache_lengths))  # type: ignore[arg-type]
        except TypeError:
            return [int(n) for n in lengths]  # type: ignore[union-attr]

    def crop(self, lengths: int | Sequence[int]) -> None:
        """Roll the KV cache back to its first `lengths[b]` positions per row (an int: the same for all)."""
        self.backend.crop(self._per_row(lengths))

    @property
    def can_retain(self) -> bool:
        """Whether the cache can keep a tree draft's accepted path (see `KVCache.retain`)."""
        return self.backend.can_retain

    @torch.inference_mode()  # the cache's tensors were made under it, and are updated in place
    def retain(self, lengths: int | Sequence[int], indices: torch.Tensor) -> None:
        """After a tree forward: keep row b's first `lengths[b]` cache positions, then the accepted nodes at
        `lengths[b] + indices[b]`, in order. indices: [B, n], or [n] for every row."""
        lengths = self._per_row(lengths)
        if indices.dim() == 1:
            indices = indices.unsqueeze(0).expand(len(lengths), -1)
        self.backend.retain(lengths, indices)

    @property
    def can_batch(self) -> bool:
        """Whether rows of different lengths can step together, leave and join (the native cache can)."""
        return type(self.backend).add_rows is not TargetBackend.add_rows

    def fork(self) -> TargetModel:
        """Another TargetModel over the same model and weights with a cache of its own (a draft model per batch
        row). Taps requested here are requested there too."""
        clone = TargetModel.__new__(TargetModel)
        clone.__dict__.update(self.__dict__)
        clone.backend = self.backend.fork()
        clone._tap_ids = []
        clone.request_taps(self._tap_ids)
        return clone

    # -- rows leaving and joining the batch (the native cache; the transformers backend refuses) ------------
    def drop_rows(self, rows: Sequence[int]) -> None:
        """Rows leave the batch: their cache rows are removed and the others close up, in order (row indices
        after the first dropped one shift down). The cache's buffer is resized for the rows that stay."""
        self.backend.drop_rows([operator.index(r) for r in rows])

    @torch.inference_mode()
    def add_rows(self, prompts: Sequence[torch.Tensor | Sequence[int]]) -> TargetOutput:
        """Rows join the batch: each prompt (token ids, 1-D or [1, T], of any lengths) is read into a new row
        after the rows held, which keep their state. Call reset() first to start a new batch (before the first
        forward a fresh cache is made). Returns, for the new rows only: logits at each prompt's last token
        [k, 1, V], and taps for every prompt position, right-padded to the longest prompt [k, T_max, H] (row j's
        first len(prompts[j]) positions are its own).

        Rows of different lengths then step together: `forward` feeds [B, n] tokens after each row's own length
        (rows with fewer tokens pad on the right, then `crop` each row to what it holds), `crop` and `retain`
        take one length per row."""
        ids = [torch.as_tensor(p, dtype=torch.long, device=self.device).reshape(-1) for p in prompts]
        if not ids:
            raise SpecdecError("add_rows needs at least one prompt.")
        empty = [j for j, p in enumerate(ids) if p.numel() == 0]
        if empty:
            raise SpecdecError(f"add_rows: prompt {empty[0]} is empty; each new row needs at least one token.")
        if self.backend.cache is None:
            self.reset()
        return self.backend.add_rows(ids, self._tap_ids)

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, logits_to_keep: int, tree_parents: TreeParents = None,
             counts: Sequence[int] | None = None) -> TargetOutput:
        assert self.backend.cache is not None, "call reset() before the first forward"
        return self.backend.forward(input_ids, self._tap_ids, logits_to_keep, tree_parents, counts)

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """Read the prompt [B, T] into a fresh cache; logits of the last position only, taps for all."""
        self.reset()
        return self._run(input_ids, logits_to_keep=1)

    @torch.inference_mode()
    def tap_hidden_states(self, input_ids: torch.Tensor, with_logits: bool = False) -> TargetOutput:
        """Taps only, for every position of [B, T], from a cache-free forward that stops at the deepest tap.

        Training needs the tapped states and nothing else: skipping the later layers and the LM head (whose
        [T, V] product costs as much as several decoder layers) makes each training step cheaper. The KV
        cache is left untouched; `logits` is empty, unless `with_logits` (distillation from the target's
        distribution) runs the whole forward and returns them for every position.
        """
        if not self._tap_ids:
            raise SpecdecError("No hidden-state taps were requested; call request_taps(layer_ids) first.")
        with self.lock.hold(inside_ok=True):  # tap hooks on a shared model see every forward: one at a time
            if self.backend.cache is None:  # training; a live generation keeps its forward
                self._recheck_backend()
            if with_logits:
                logits, taps = self.backend.taps_and_logits(input_ids, self._tap_ids)
                return TargetOutput(logits=logits, taps=taps)
            logits = torch.empty(input_ids.shape[0], 0, self.vocab_size, device=input_ids.device, dtype=self.dtype)
            return TargetOutput(logits=logits, taps=self.backend.taps_only(input_ids, self._tap_ids))

    def forward_last(self, input_ids: torch.Tensor, counts: Sequence[int]) -> TargetOutput:
        """Feed [B, n] right-padded tokens after each row's cached ones: row b's first counts[b] (0 to n) are
        real, and the cache counts only those. Logits at each row's last real token only [B, 1, V] (a row with
        nothing real gets an unused row), where `forward` would compute all n: a drafter that only needs the
        next token's logits skips n - 1 LM-head products per row. Rows of different counts need the native
        cache; the transformers backend takes rows whose tokens are all real."""
        if len(counts) != input_ids.shape[0] or any(not 0 <= int(c) <= input_ids.shape[1] for c in counts):
            raise ValueError(f"forward_last takes one count in 0..{input_ids.shape[1]} per row of "
                             f"{input_ids.shape[0]}, not {list(counts)}.")
        return self._run(input_ids, logits_to_keep=1, counts=counts)

    def forward(self, input_ids: torch.Tensor, tree_parents: TreeParents = None) -> TargetOutput:
        """Feed [B, n] tokens at the positions following the cache; logits for all n positions. With
        `tree_parents` (n - 1 ints, see `specdec.tree`) the tokens after the first form a tree under it; a list
        of such lists gives each row its own tree (the native cache only)."""
        return self._run(input_ids, logits_to_keep=0, tree_parents=tree_parents)

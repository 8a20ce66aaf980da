"""How large a draft one engine step may verify, and the bound every size-like proposer option takes from it.

A decoding step verifies its draft in one target forward over [last committed token, draft...]: that forward's
time and memory grow with the draft (logits [1 + n, V], a tree mask n x (context + n), the keys and values of n
more positions), and so does the proposer's own work per step (a tree's width, the n-grams it indexes). An
option without a bound let one typo, `--opt tree_width=100000`, grow memory until the kernel killed the process
(issue 25). So every size-like option of every proposer is bounded here, by what one verification forward may
hold, never by the vocabulary:

- `MAX_VERIFY_TOKENS`: the fixed ceiling on the draft tokens of one verification forward (why 256: below);
- `verify_capacity(max_context)`: that ceiling for one target, lower when its context window is smaller;
- `at_most(limit, why)`: the static bound on a proposer's Config field, checked by pydantic as the options are
  parsed, before any model loads (`--opt tree_width=100000` is refused at once);
- `check_at_most(...)`: the same sentence for a bound that needs the target or the draft, checked when the
  proposer is built, before any draft weights load.

Each refusal is one sentence naming the option, the bound and why.
"""

from __future__ import annotations

from typing import Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from .errors import SpecdecError

#: The most draft tokens (a chain's length, or a tree's nodes) one verification forward may hold. Why 256:
#: speculation pays only while verifying n tokens costs about what decoding one does, i.e. while the target's
#: forward stays bound by reading its weights, which ends at a few hundred tokens per forward on current GPUs
#: (far fewer on a CPU), so a larger draft costs more per step than it can save; the largest drafts published
#: methods verify per step are well below it (EAGLE-2/EAGLE-3 trees of 60 nodes, DFlash blocks of 16, Medusa
#: trees of 64), so no useful setting is refused; and at 256 one step's extra memory stays small: logits
#: [257, V] (150 MB in float32 for a 150k vocabulary) and a 257 x (context + 257) tree mask.
MAX_VERIFY_TOKENS = 256

#: Why a draft-size option is bounded by MAX_VERIFY_TOKENS (completes "N is more than LIMIT, ...").
VERIFY_WHY = "the most draft tokens one verification forward may hold"

#: The longest n-gram prompt lookup matches (ngram's `min_n` and `max_n`, dflash's `lookup`). Why 16: prompt
#: lookup matches suffixes of a few tokens (transformers' default is 2, vLLM's usual settings 3 to 5), and an
#: exact repeat of 16 tokens already pins its continuation down; the index keeps every n-gram with
#: min_n <= n <= max_n of every committed token as a Python tuple, so its memory per token grows with the square
#: of max_n: measured on 4,096 random tokens, 0.8 KB per token at max_n=3, 8 KB at 16 (250 MB for a 32k-token
#: context), 26 KB at 32.
MAX_NGRAM = 16

#: Why an n-gram length is bounded by MAX_NGRAM.
NGRAM_WHY = ("the longest n-gram prompt lookup indexes (its index keeps every n-gram of every token, so it grows "
             "with the square of the length)")


def verify_capacity(max_context: int) -> int:
    """The most draft tokens one verification forward may hold for a target whose context window is
    `max_context`: MAX_VERIFY_TOKENS, or fewer for a short window (a prompt of at least one token and the token
    prefill commits leave max_context - 2 positions for a draft)."""
    return max(1, min(MAX_VERIFY_TOKENS, max_context - 2))


def capacity_why(max_context: int) -> str:
    """Why `verify_capacity(max_context)` bounds a draft-size option, for check_at_most."""
    if verify_capacity(max_context) < MAX_VERIFY_TOKENS:
        return f"{VERIFY_WHY} within this target's context window of {max_context} tokens"
    return VERIFY_WHY


def too_large(value: int, limit: int, why: str) -> str:
    """The end of a refusal: "<value> is more than <limit>, <why>; choose at most <limit>"."""
    return f"{value} is more than {limit}, {why}; choose at most {limit}"


def at_most(limit: int, why: str) -> AfterValidator:
    """A Config field's static bound (use in `Annotated[int, at_most(...)]`): a larger value is refused as the
    options are parsed, before anything loads, with `why` in the message."""

    def check(value: Any) -> Any:
        if value is not None and value > limit:
            raise PydanticCustomError("too_large", "{text}", {"text": too_large(value, limit, why)})
        return value

    return AfterValidator(check)


def check_at_most(proposer: str, option: str, value: int | None, limit: int, why: str) -> None:
    """A bound that needs the target or the draft, checked when the proposer is built: one sentence, worded
    as a refused option is everywhere else."""
    if value is not None and value > limit:
        raise SpecdecError(f"Invalid option {option!r} for proposer {proposer!r}: {too_large(value, limit, why)}.")


def check_draft_sizes(proposer: str, max_context: int, **options: int | None) -> None:
    """Each of `options` (name=value: the draft tokens it may put in one verification forward) within
    verify_capacity(max_context)."""
    limit, why = verify_capacity(max_context), capacity_why(max_context)
    for option, value in options.items():
        check_at_most(proposer, option, value, limit, why)

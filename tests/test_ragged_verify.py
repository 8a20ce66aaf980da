"""Batched verification: the ragged layout (vLLM's flat draft tokens with per-row offsets) and the per-row tree
walk with tensor operations.

- the ragged torch references equal the padded functions row by row (same draws laid out ragged), and with
  one generator at B = 1 (or equal lengths) the padded functions themselves; per-row generators reproduce
  each row alone;
- the ragged Triton kernels equal the references bit for bit (Triton's interpreter on the CPU, set up as in
  tests/test_kernels.py: TRITON_INTERPRET=1 before any kernel is decorated);
- the ragged sampler's output is distributed as the target's, row by row (chi-square, as tests/test_sampling.py);
- `tree.verify_tree_batched` equals `tree.verify_tree` on random trees, shared or per row, duplicate siblings
  included, and its sampled chooser is the tree verifier's draw for B = 1 and the target's law for any B.
"""

from __future__ import annotations

import importlib
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, i.e. when the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import specdec_kernels.dispatch as dispatch  # noqa: E402
from specdec import tree  # noqa: E402
from specdec_kernels.reference import (  # noqa: E402
    draw_randoms,
    draw_randoms_ragged,
    greedy_verify_ragged_torch,
    greedy_verify_torch,
    pad_ragged,
    rejection_sample_ragged_torch,
    rejection_sample_torch,
)

try:
    import specdec_kernels.triton_kernels as tk
    import specdec_kernels.triton_ragged as tr
except ImportError:  # no triton on this platform: only the reference and tree tests run
    tk = tr = None
else:
    if DEVICE == "cpu" and type(tk._argmax_partials_kernel).__name__ != "InterpretedFunction":
        tk = importlib.reload(tk)  # imported earlier without the interpreter: decorate again under it
        tr = importlib.reload(tr)  # and take the reloaded building blocks
    elif tr.launch_greedy is not tk.launch_greedy:
        tr = importlib.reload(tr)  # an earlier reload of tk left tr holding the compiled launchers

needs_triton = pytest.mark.skipif(tr is None, reason="triton is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
EXAMPLES = int(os.environ.get("SPECDEC_KERNEL_TEST_EXAMPLES", "40"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16]
BLOCKS = st.sampled_from([None, 16, 64])
SPLITS = st.sampled_from([None, 1, 3])


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64 and g.shape == w.shape, (g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), f"\n got {g.tolist()}\nwant {w.tolist()}"


def _cu(ks: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(ks, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int64)


def _pad_row(result, width: int):
    """A padded function's [1, k+1] result for one row, padded with -1 to the ragged width."""
    n, emitted = result
    return n, torch.cat([emitted, emitted.new_full((1, width - emitted.shape[1]), -1)], dim=1)


def _rows(ks: list[int]):
    """(b, start, end) of each row's drafts; its target rows are start + b .. end + b."""
    cu = _cu(ks).tolist()
    return [(b, cu[b], cu[b + 1]) for b in range(len(ks))]


# ------------------------------------------------------------------------------------------------------------
# Case generators: hypothesis draws the structure (B in 1..8, k_b in 0..8), a seeded generator the tensors.
# ------------------------------------------------------------------------------------------------------------

LENGTHS = st.integers(1, 8).flatmap(lambda b: st.lists(st.integers(0, 8), min_size=b, max_size=b))
VOCABS = st.one_of(st.integers(1, 8), st.integers(1, 300))


@st.composite
def greedy_cases(draw):
    ks, vocab, dtype = draw(LENGTHS), draw(VOCABS), draw(st.sampled_from(DTYPES))
    spread = draw(st.sampled_from([1, 3, 1000]))  # small spreads: ties everywhere
    p_follow = draw(st.sampled_from([0.0, 0.8, 1.0]))  # chance a draft token is the target's argmax
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    batch, m = len(ks), sum(ks)
    logits = torch.randint(-spread, spread + 1, (m + batch, vocab), generator=g).double()
    logits = (logits + (spread == 1000) * torch.rand(logits.shape, generator=g, dtype=torch.float64)).to(dtype)
    row_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(ks, dtype=torch.int64))
    judged = logits.argmax(-1)[torch.arange(m) + row_of]  # draft token i is judged at target row i + b
    follow = torch.rand(m, generator=g) < p_follow
    draft = torch.where(follow, judged, torch.randint(0, vocab, (m,), generator=g))
    return ks, logits, draft


@st.composite
def rejection_cases(draw):
    ks, vocab, dtype = draw(LENGTHS), draw(VOCABS), draw(st.sampled_from(DTYPES))
    discrete = draw(st.booleans())  # probabilities on a grid: ties in the race and on the accept boundary
    p_zero = draw(st.sampled_from([0.0, 0.3, 0.8]))
    with_q = draw(st.booleans())  # probability drafts, else point masses
    draft_mode = draw(st.sampled_from(["random", "from_q", "zero_q", "zero_p", "follow_p"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    batch, m = len(ks), sum(ks)

    def probs(rows: int) -> torch.Tensor:
        if discrete:
            w = torch.randint(0, 4, (rows, vocab), generator=g).double()
        else:
            w = torch.rand(rows, vocab, generator=g, dtype=torch.float64) ** 3
        w[torch.rand(rows, vocab, generator=g) < p_zero] = 0.0
        return (w / w.sum(-1, keepdim=True).clamp_min(1e-300)).to(dtype)

    p, q = probs(m + batch), probs(m)
    row_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(ks, dtype=torch.int64))
    judged = torch.arange(m) + row_of
    draft = torch.randint(0, vocab, (m,), generator=g)
    if draft_mode == "from_q" and m > 0:
        w = q.double()
        draft = torch.multinomial(torch.where(w.sum(-1, keepdim=True) > 0, w, 1.0), 1, generator=g).view(m)
    elif draft_mode == "follow_p" and m > 0:  # long accepted runs
        draft = p[judged].double().argmax(-1)
    if draft_mode == "zero_q":  # the draft "proposed" a token it gives probability 0
        q[torch.arange(m), draft] = 0.0
    if draft_mode == "zero_p":  # the target gives the drafted token probability 0
        p[judged, draft] = 0.0
    uniforms, exponentials = draw_randoms_ragged(_cu(ks), m, vocab, torch.device("cpu"), g)
    if draw(st.booleans()):  # exponentials on a grid: exact ties in the race
        exponentials = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)[torch.randint(0, 3, (batch, vocab),
                                                                                         generator=g)]
    return ks, p, draft, (q if with_q else None), uniforms, exponentials


# ------------------------------------------------------------------------------------------------------------
# Reference: ragged == padded, row by row.
# ------------------------------------------------------------------------------------------------------------


@FAST
@given(case=greedy_cases(), extra=st.integers(0, 2))
def test_greedy_ragged_reference_is_the_padded_function_row_by_row(case, extra):
    ks, logits, draft = case
    width = max(ks) + 1 + extra
    got = greedy_verify_ragged_torch(logits, draft, _cu(ks), max_num_draft_tokens=width - 1 if extra else None)
    for b, s, e in _rows(ks):
        want = _pad_row(greedy_verify_torch(logits[s + b:e + b + 1][None], draft[s:e][None]), width)
        _same((got[0][b:b + 1], got[1][b:b + 1]), want)


@FAST
@given(case=rejection_cases())
def test_rejection_ragged_reference_is_the_padded_function_row_by_row(case):
    ks, p, draft, q, u, e = case
    got = rejection_sample_ragged_torch(p, draft, _cu(ks), q, uniforms=u, exponentials=e)
    for b, s, t in _rows(ks):
        row_q = None if q is None else q[s:t][None]
        want = rejection_sample_torch(p[s + b:t + b + 1][None], draft[s:t][None], row_q,
                                      uniforms=u[s:t][None], exponentials=e[b:b + 1])
        _same((got[0][b:b + 1], got[1][b:b + 1]), _pad_row(want, max(ks) + 1))


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("with_q", [False, True])
def test_one_generator_at_batch_1_draws_what_the_padded_function_draws(k, with_q):
    """Same seed, B = 1: the ragged dispatch (both backends) returns what `rejection_sample` returns."""
    g = torch.Generator().manual_seed(7 + k)
    vocab = 40
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1) if with_q else None
    draft = p[:k].argmax(-1) if k % 2 else torch.randint(0, vocab, (k,), generator=g)
    backends = ["torch"] + (["triton"] if tr is not None else [])
    for seed in range(5):
        want = dispatch.rejection_sample(p[None].to(DEVICE), draft[None].to(DEVICE),
                                         None if q is None else q[None].to(DEVICE),
                                         torch.Generator(device=DEVICE).manual_seed(seed), backend="torch")
        for backend in backends:
            got = dispatch.rejection_sample_ragged(p.to(DEVICE), draft.to(DEVICE), _cu([k]).to(DEVICE),
                                                   None if q is None else q.to(DEVICE),
                                                   torch.Generator(device=DEVICE).manual_seed(seed), backend=backend)
            _same(got, want)
            _same(dispatch.greedy_verify_ragged(p.to(DEVICE), draft.to(DEVICE), _cu([k]).to(DEVICE), backend=backend),
                  dispatch.greedy_verify(p[None], draft[None], backend="torch"))


def test_equal_lengths_draw_what_the_padded_batch_draws():
    g = torch.Generator().manual_seed(1)
    batch, k, vocab = 5, 3, 30
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    draft = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(batch, k)
    want = dispatch.rejection_sample(p, draft, q, torch.Generator().manual_seed(3), backend="torch")
    got = dispatch.rejection_sample_ragged(p.view(-1, vocab), draft.view(-1), _cu([k] * batch), q.view(-1, vocab),
                                           torch.Generator().manual_seed(3), backend="torch")
    _same(got, want)


def test_per_row_generators_reproduce_each_row_alone():
    """A generator per row: row b is `rejection_sample` on row b alone with generators[b], whatever the other
    rows hold (a row's seed reproduces its output in any batch)."""
    g = torch.Generator().manual_seed(2)
    ks, vocab = [2, 0, 5, 1, 3], 25
    m, batch = sum(ks), len(ks)
    p = torch.softmax(torch.randn(m + batch, vocab, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(m, vocab, generator=g), -1)
    draft = torch.multinomial(q, 1, generator=g).view(m)
    seeds = [11, 12, 13, 14, 15]
    backends = ["torch"] + (["triton"] if tr is not None else [])
    for backend in backends:
        gens = [torch.Generator(device=DEVICE).manual_seed(s) for s in seeds]
        got = dispatch.rejection_sample_ragged(p.to(DEVICE), draft.to(DEVICE), _cu(ks).to(DEVICE), q.to(DEVICE),
                                               gens, backend=backend)
        for b, s, t in _rows(ks):
            row = [x[None].to(DEVICE) for x in (p[s + b:t + b + 1], draft[s:t], q[s:t])]
            want = dispatch.rejection_sample(*row, torch.Generator(device=DEVICE).manual_seed(seeds[b]),
                                             backend="torch")
            _same((got[0][b:b + 1], got[1][b:b + 1]), _pad_row(want, max(ks) + 1))
    with pytest.raises(ValueError, match="2 generators for 5 rows"):
        draw_randoms_ragged(_cu(ks), m, vocab, torch.device("cpu"), gens[:2])


def test_bad_ragged_input_is_named():
    logits, draft = torch.zeros(5, 4), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="has 5 rows; 3 draft tokens in 1 rows need 4"):
        greedy_verify_ragged_torch(logits, draft, _cu([3]))
    with pytest.raises(ValueError, match="must rise from 0"):
        greedy_verify_ragged_torch(logits, draft, torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="more than max_num_draft_tokens=1"):
        greedy_verify_ragged_torch(logits, draft, _cu([2, 1]), max_num_draft_tokens=1)
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample_ragged_torch(logits, draft, _cu([2, 1]), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="floating point"):
        greedy_verify_ragged_torch(logits.long(), draft, _cu([2, 1]))
    assert pad_ragged(torch.tensor([5, 6, 7]), _cu([2, 0, 1]), 3, -1).tolist() == [[5, 6, -1], [-1] * 3, [7, -1, -1]]


# ------------------------------------------------------------------------------------------------------------
# Kernel == reference, bit for bit.
# ------------------------------------------------------------------------------------------------------------


@needs_triton
@FAST
@given(case=greedy_cases(), block_v=BLOCKS, num_splits=SPLITS)
def test_greedy_ragged_kernel_matches_reference(case, block_v, num_splits):
    ks, logits, draft = case
    cu = _cu(ks)
    got = tr.greedy_verify_ragged_triton(logits.to(DEVICE), draft.to(DEVICE), cu.to(DEVICE),
                                         block_v=block_v, num_splits=num_splits)
    _same(got, greedy_verify_ragged_torch(logits, draft, cu))


@needs_triton
@FAST
@given(case=rejection_cases(), block_v=BLOCKS, num_splits=SPLITS)
def test_rejection_ragged_kernel_matches_reference(case, block_v, num_splits):
    ks, p, draft, q, u, e = case
    cu = _cu(ks)
    dev = [None if t is None else t.to(DEVICE) for t in (p, draft, cu, q, u, e)]
    got = tr.rejection_sample_ragged_triton(*dev, block_v=block_v, num_splits=num_splits)
    _same(got, rejection_sample_ragged_torch(p, draft, cu, q, uniforms=u, exponentials=e))


@needs_triton
@pytest.mark.parametrize("with_q", [False, True])
def test_kernels_at_batch_64_with_empty_rows_and_a_wider_output(with_q):
    g = torch.Generator().manual_seed(64)
    ks = torch.randint(0, 9, (64,), generator=g)
    ks[::5] = 0
    ks = ks.tolist()
    vocab, m, batch = 500, sum(ks), len(ks)
    logits = torch.randn(m + batch, vocab, generator=g).to(torch.bfloat16)
    row_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(ks))
    draft = logits.argmax(-1)[torch.arange(m) + row_of]
    draft[torch.rand(m, generator=g) < 0.2] = 3
    p = torch.softmax(logits.float() * 0.3, -1)
    q = torch.softmax(torch.randn(m, vocab, generator=g), -1) if with_q else None
    u, e = draw_randoms_ragged(_cu(ks), m, vocab, torch.device("cpu"), g)
    dev = [None if t is None else t.to(DEVICE) for t in (logits, p, draft, _cu(ks), q, u, e)]
    if not with_q:  # greedy once: the interpreter runs one program per target row here
        _same(tr.greedy_verify_ragged_triton(dev[0], dev[2], dev[3], max_num_draft_tokens=10),
              greedy_verify_ragged_torch(logits, draft, _cu(ks), max_num_draft_tokens=10))
    _same(tr.rejection_sample_ragged_triton(dev[1], dev[2], dev[3], dev[4], dev[5], dev[6]),
          rejection_sample_ragged_torch(p, draft, _cu(ks), q, uniforms=u, exponentials=e))
    # every row empty: M = 0
    zeros = _cu([0] * batch).to(DEVICE)
    empty = draft[:0].to(DEVICE)
    u0, e0 = draw_randoms_ragged(_cu([0] * batch), 0, vocab, torch.device("cpu"), g)
    _same(tr.greedy_verify_ragged_triton(dev[0][:batch], empty, zeros),
          greedy_verify_ragged_torch(logits[:batch], draft[:0], _cu([0] * batch)))
    _same(tr.rejection_sample_ragged_triton(dev[1][:batch], empty, zeros, None if q is None else dev[4][:0],
                                            u0.to(DEVICE), e0.to(DEVICE)),
          rejection_sample_ragged_torch(p[:batch], draft[:0], _cu([0] * batch), None if q is None else q[:0],
                                        uniforms=u0, exponentials=e0))


# ------------------------------------------------------------------------------------------------------------
# The ragged sampler is lossless row by row (chi-square, tests/test_sampling.py's helper and level).
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_q", [True, False])
def test_ragged_rejection_sampler_output_is_the_targets_per_row(with_q):
    """Four kinds of row interleaved in one ragged batch, k = 0, 1, 3 and 2, drafted from q (verified with q,
    or as point masses). Per kind: the first emitted token is distributed as p at the row's first position;
    the token after a fully accepted draft as p at its last position; for k = 3, the token at a rejection at
    position 1 as norm(max(0, p_1 - q_1)) (q_1: the draft's law, or the point mass on the drafted token). A
    wrong offset (another row's or position's p or q, or uniforms) fails."""
    from test_sampling import ALPHA, chi_square_p_value

    g = torch.Generator().manual_seed(5 + with_q)
    vocab, reps, ks_kind = 6, 15000, [0, 1, 3, 2]

    def dirichlet(rows: int) -> torch.Tensor:
        w = torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=g) + 0.3
        return w / w.sum(-1, keepdim=True)

    ps = [dirichlet(k + 1) for k in ks_kind]
    qs = [dirichlet(k) for k in ks_kind]
    ps[0][0, 5] = 0.0  # a token the target never emits
    ps[0] /= ps[0].sum(-1, keepdim=True)
    ks = ks_kind * reps
    kind_of = torch.arange(len(ks)) % len(ks_kind)
    p_flat = torch.cat(ps * reps)
    q_flat = torch.cat(qs * reps)
    draft = torch.multinomial(q_flat, 1, generator=g).view(-1)
    n, emitted = dispatch.rejection_sample_ragged(p_flat, draft, _cu(ks), q_flat if with_q else None, g,
                                                  backend="torch")
    for index, k in enumerate(ks_kind):
        rows = kind_of == index
        first = torch.bincount(emitted[rows, 0], minlength=vocab).double()
        assert chi_square_p_value(first, ps[index][0]) > ALPHA, (k, "first token")
        full = rows & (n == k)
        bonus = torch.bincount(emitted[full, k], minlength=vocab).double()
        assert bonus.sum() > 50 and chi_square_p_value(bonus, ps[index][k]) > ALPHA, (k, "bonus")
    # k = 3 rows rejected at position 1: the residual there (with point masses: given the drafted token)
    rows = ((kind_of == 2) & (n == 1)).nonzero().view(-1)
    drafted = draft.view(reps, -1)[:, 1 + 1]  # each rep holds 0 + 1 + 3 + 2 drafts; position 1 of the k = 3 row
    for token in range(vocab) if not with_q else [None]:
        pick = rows if token is None else rows[drafted[rows // len(ks_kind)] == token]
        q1 = qs[2][1] if token is None else torch.nn.functional.one_hot(torch.tensor(token), vocab).double()
        residual = (ps[2][1] - q1).clamp_min(0)
        counts = torch.bincount(emitted[pick, 1], minlength=vocab).double()
        if counts.sum() >= 200:
            assert chi_square_p_value(counts, residual / residual.sum()) > ALPHA, ("residual", token)


# ------------------------------------------------------------------------------------------------------------
# Tree walk per row with tensor operations.
# ------------------------------------------------------------------------------------------------------------


@st.composite
def tree_cases(draw):
    batch = draw(st.integers(1, 6))

    def one_tree():
        return [draw(st.integers(-1, j - 1)) for j in range(draw(st.integers(0, 9)))]

    shared = draw(st.booleans())
    trees = [one_tree()] * batch if shared else [one_tree() for _ in range(batch)]
    k = max(len(t) for t in trees) + draw(st.integers(0, 1))  # sometimes padding after every row's tree
    alphabet = draw(st.integers(1, 3))  # few token ids: duplicate siblings and long walks are common
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    tokens = torch.randint(0, alphabet, (batch, k), generator=g)
    chosen = torch.randint(0, alphabet, (batch, k + 1), generator=g)
    form = draw(st.sampled_from(["lists", "tensor"] + (["shared"] if shared and k == len(trees[0]) else [])))
    return trees, tokens, chosen, form, draw(st.integers(0, 2))


@settings(max_examples=200, deadline=None)
@given(case=tree_cases())
def test_batched_tree_walk_is_verify_tree_row_by_row(case):
    trees, tokens, chosen, form, extra_levels = case
    batch, k = tokens.shape
    if form == "shared":
        parents = trees[0]
    elif form == "lists":
        parents = trees
    else:
        parents = torch.tensor([t + [-2] * (k - len(t)) for t in trees])
    levels = None
    if extra_levels:
        levels = max((max(tree.depths(t), default=0) for t in trees), default=0) + extra_levels
    got = tree.verify_tree_batched(chosen, tokens, parents, levels=levels)
    table = chosen.tolist()
    for b, parents_b in enumerate(trees):
        kb = len(parents_b)
        n, emitted, path = tree.verify_tree(lambda _, i, b=b: table[b][i], tokens[b:b + 1, :kb], parents_b)
        assert got[0][b] == n[0]
        assert got[1][b].tolist() == emitted[0].tolist() + [-1] * (k - kb)
        assert got[2][b].tolist() == path[0].tolist() + [-1] * (k - kb)
    if form == "shared":  # the whole batch at once, as verify_tree takes it
        want = tree.verify_tree(lambda b, i: table[b][i], tokens, parents)
        for g_, w in zip(got, want, strict=True):
            assert torch.equal(g_, w)
    # a callable chooser asked once per level gives the same walk
    calls = []

    def choose(nodes):
        calls.append(nodes.clone())
        return chosen.gather(1, (nodes + 1).unsqueeze(1)).squeeze(1)

    for g_, w in zip(tree.verify_tree_batched(choose, tokens, parents), got, strict=True):
        assert torch.equal(g_, w)
    assert len(calls) == int(got[0].max()) + 1


def test_batched_walk_takes_the_first_child_holding_the_token():
    tokens, parents = [5, 6, 7, 6, 9], [-1, 0, 1, 0, 3]  # node 0 has two children holding 6: nodes 1 and 3
    chosen = torch.tensor([[5, 6, 9, 0, 0, 0], [5, 6, 7, 0, 9, 0]])
    n, emitted, path = tree.verify_tree_batched(chosen, torch.tensor([tokens, tokens]), parents)
    assert n.tolist() == [2, 3] and path.tolist() == [[0, 1, -1, -1, -1], [0, 1, 2, -1, -1]]
    assert emitted.tolist() == [[5, 6, 9, -1, -1, -1], [5, 6, 7, 0, -1, -1]]
    n, emitted, path = tree.verify_tree_batched(torch.tensor([[4]]), torch.zeros(1, 0, dtype=torch.long), [])
    assert n.tolist() == [0] and emitted.tolist() == [[4]] and path.shape == (1, 0)
    with pytest.raises(ValueError, match=r"row 1: parents\[1\] is 1"):
        tree.verify_tree_batched(chosen, torch.tensor([tokens, tokens]), [parents, [-1, 1]])
    with pytest.raises(ValueError, match=r"row 0: parents\[2\] is 1"):  # the parent is padding
        tree.verify_tree_batched(chosen[:1], torch.tensor([tokens]), torch.tensor([[-1, -2, 1, 0, 0]]))


def test_sampled_chooser_at_batch_1_is_the_tree_verifiers_draw():
    """Same generator seed: the batched walk with `sampled_chooser` emits what RejectionSamplingVerifier's
    tree path emits, and leaves the generator in the same state (one [V] race per node reached)."""
    from specdec import Draft, SamplingParams
    from specdec.sampling import logits_to_probs
    from specdec.verifiers import RejectionSamplingVerifier

    tokens, parents = [1, 0, 1, 1, 2, 0, 1], [-1, -1, 0, 0, 1, 2, 5]
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, len(tokens) + 1, 3, generator=g, dtype=torch.float64)
    params = SamplingParams(temperature=0.8)
    draft = torch.tensor([tokens])
    depths = set()
    for seed in range(40):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = RejectionSamplingVerifier().verify(logits, Draft(tokens=draft, parents=parents), params, g1)
        got = tree.verify_tree_batched(tree.sampled_chooser(logits_to_probs(logits, params), g2), draft, parents)
        assert got[0].tolist() == want.num_accepted.tolist() and torch.equal(got[1], want.emitted)
        assert torch.rand(1, generator=g1) == torch.rand(1, generator=g2)
        depths.add(int(got[0]))
    assert len(depths) >= 3  # the walks reached several depths


def test_sampled_batched_walk_draws_each_path_with_the_targets_probability():
    """The joint law of what one tree step emits, for many rows at once (finished rows keep drawing at every
    level, which must not bias the others), against its exact value."""
    from test_sampling import ALPHA, chi_square_p_value

    vocab, rows = 3, 12000
    tokens, parents = [0, 1, 0, 2, 1], [-1, -1, 0, 0, 2]
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(len(tokens) + 1, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    draft = torch.tensor([tokens]).expand(rows, -1)
    _, emitted, _ = tree.verify_tree_batched(tree.sampled_chooser(probs.expand(rows, -1, -1), gen), draft, parents)
    law: dict[tuple[int, ...], float] = {}

    def expand(node: int, prefix: tuple[int, ...], weight: float) -> None:
        for x in range(vocab):
            child = next((c for c, p in enumerate(parents) if p == node and tokens[c] == x), None)
            w = weight * float(probs[node + 1, x])
            if child is None:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + w
            else:
                expand(child, prefix + (x,), w)

    expand(-1, (), 1.0)
    outcomes = sorted(law)
    seen = [tuple(t for t in row if t >= 0) for row in emitted.tolist()]
    counts = torch.tensor([seen.count(o) for o in outcomes], dtype=torch.float64)
    assert counts.sum() == rows
    assert chi_square_p_value(counts, torch.tensor([law[o] for o in outcomes])) > ALPHA


def test_draw_randoms_ragged_at_batch_1_is_draw_randoms():
    for k in (0, 3):
        u1, e1 = draw_randoms(1, k, 17, torch.device("cpu"), torch.Generator().manual_seed(k))
        u2, e2 = draw_randoms_ragged(_cu([k]), k, 17, torch.device("cpu"), torch.Generator().manual_seed(k))
        assert torch.equal(u1.view(-1), u2) and torch.equal(e1, e2)

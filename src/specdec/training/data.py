"""Target-regenerated training data: the target answers each prompt itself (the DFlash and EAGLE recipe).

On-disk format of a data directory (format 2; every file is written atomically, temporary file + rename, so
an interrupted or killed run leaves the previous state whole and resumes cleanly):

- ``index.json``: ``{"format": 2, "id_scheme": "sha256-prompt", "target": {"name_or_path", "vocab_size",
  "tokenizer_sha256"}, "generation": {...settings...}, "shards": [{"file", "ids", "num_tokens",
  "num_response_tokens", "generation": {"max_new_tokens", "max_prompt_tokens", "temperature", "target"}}]}``
- ``shard-00000.safetensors``: ``tokens`` int32 [N] (every sequence, prompt then response, concatenated),
  ``loss_mask`` uint8 [N] (1 on response tokens, the closing EOS included), ``offsets`` int64 [S + 1]
  (sequence i is ``tokens[offsets[i]:offsets[i + 1]]``).
- ``.specdec-owner`` (the folder is specdec's, see `specdec.files`) and ``.specdec-lock`` (held while a
  `specdec data generate` writes, so a second one into the same folder is refused).

Ids. An example's id is ``sha256:`` + the first 32 hex digits of the SHA-256 of its prompt text (UTF-8), so
the same prompt text is the same example wherever it comes from (two files holding it give one example; the
`id` field of a prompt line does not enter: the text alone decides what the target answers), and different
prompts never share an id (two ``good.jsonl`` from different folders both land in the data). Format 1
indexes (no ``id_scheme``) used ``<file stem>:<id field or line number>``; a resume over such an index keeps
those old ids for the prompts it adds, so nothing is duplicated or lost (and the old collision of same-named
files remains for that directory; generate into a new folder to get content ids). Readers (the trainer)
read both formats.

Settings. The generation settings that decide the data (``max_new_tokens``, ``max_prompt_tokens``,
``temperature``, ``target``: the model's name or its folder's absolute path) are recorded in the index's
``generation`` and in every shard; a resume with any of them different is refused with a sentence naming it.
``prompt_files`` lists every prompt file any run used, ``shuffle_seed`` the first run's seed.

Flushing. Finished sequences are written as a new shard every ``sequences_per_shard`` sequences, at the
first finished batch ``flush_seconds`` after the previous shard, at the end, and when SIGINT or SIGTERM
arrives (the batch in flight is dropped, everything finished is written, then `Interrupted` is raised; the
CLI exits with 128 + the signal number). A SIGKILL loses at most what finished since the last shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import SpecdecError
from ..files import OWNER_MARKER, atomic_save_file, atomic_write_json, claim_output_dir
from ..jsonl import read_jsonl
from .interrupts import Interrupted, InterruptGuard, folder_lock

FORMAT_VERSION = 2
ID_SCHEME = "sha256-prompt"
SETTINGS = {"max_new_tokens": "--max-new-tokens", "max_prompt_tokens": "--max-prompt-tokens",
            "temperature": "--temperature", "target": "--model"}


def prompt_key(text: str) -> str:
    """The content id of a prompt: the same text gives the same id, different texts different ids."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class PromptRecord:
    id: str  # where it came from: "<file stem>:<id field or line number>" (the format 1 data id)
    text: str

    @property
    def key(self) -> str:
        return prompt_key(self.text)


def read_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """JSONL with a `prompt` field, or the `turns` form of the evaluation sets (first turn used)."""
    file = Path(path)
    records = []
    for where, row in read_jsonl(file, "Prompts file"):
        text = row.get("prompt")
        if text is None and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise SpecdecError(f"{where} has no non-empty `prompt` (or `turns`) field; fix that line.")
        records.append(PromptRecord(id=f"{file.stem}:{row.get('id', where.rpartition(' ')[2])}", text=text))
    return records


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def target_label(name: str) -> str:
    """How the target is recorded among the settings: a local folder by its absolute path, else the name."""
    return str(Path(name).resolve()) if os.path.isdir(name) else name


def generation_settings(max_new_tokens: int, max_prompt_tokens: int, temperature: float, target: str) -> dict:
    return {"max_new_tokens": int(max_new_tokens), "max_prompt_tokens": int(max_prompt_tokens),
            "temperature": float(temperature), "target": target_label(target)}


class DataDir:
    """Reads and appends shards of a data directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.index_file = self.path / "index.json"

    def exists(self) -> bool:
        return self.index_file.is_file()

    def read_index(self) -> dict:
        if not self.exists():
            raise SpecdecError(f"{self.path} is not a specdec data directory (no index.json); create it with "
                               "`specdec data generate`.")
        try:
            index = json.loads(self.index_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
            raise SpecdecError(f"{self.index_file} is not valid JSON ({reason}); restore it or regenerate the data "
                               "into a new folder.") from None
        if not isinstance(index, dict) or not isinstance(index.get("shards"), list) or "target" not in index:
            raise SpecdecError(f"{self.index_file} is not a specdec data index (no `target` and `shards`); point "
                               "at a folder made by `specdec data generate`.")
        if index.get("format", 1) > FORMAT_VERSION:
            raise SpecdecError(f"{self.index_file} has format {index['format']}, newer than this specdec reads "
                               f"({FORMAT_VERSION}); upgrade specdec.")
        return index

    def check_target(self, tokenizer: Any) -> dict:
        index = self.read_index()
        if index["target"]["tokenizer_sha256"] != tokenizer_fingerprint(tokenizer):
            raise SpecdecError(f"The data in {self.path} was generated with another target's tokenizer "
                               f"({index['target']['name_or_path']}); regenerate it with this target.")
        return index

    def check_settings(self, index: dict, settings: dict) -> None:
        """Refuse to add data made with other settings than the ones the index records."""
        recorded = dict(index.get("generation") or {})
        if "target" not in recorded and index.get("target", {}).get("name_or_path") is not None:
            recorded["target"] = index["target"]["name_or_path"]  # format 1: the target as it was given
        for key, option in SETTINGS.items():
            if key not in recorded or key not in settings:
                continue
            old, new = recorded[key], settings[key]
            same = target_label(str(old)) == new if key == "target" else old == new
            if not same:
                raise SpecdecError(f"The data in {self.path} was generated with {option} {old}, not {new}; "
                                   f"resume it with {option} {old}, or write the new data to another --out.")

    def done_ids(self) -> set[str]:
        if not self.exists():
            return set()
        return {i for shard in self.read_index()["shards"] for i in shard["ids"]}

    def write_index(self, index: dict) -> None:
        atomic_write_json(self.index_file, index, indent=None)

    def append_shard(self, index: dict, ids: list[str], sequences: list[tuple[list[int], list[int]]],
                     generation: dict | None = None) -> None:
        """Write the sequences as the next shard, then the index naming it (each file atomically: a kill in
        between leaves a shard no index names, which the next shard replaces)."""
        tokens = torch.tensor([t for seq, _ in sequences for t in seq], dtype=torch.int32)
        mask = torch.tensor([m for _, ms in sequences for m in ms], dtype=torch.uint8)
        lengths = torch.tensor([0] + [len(seq) for seq, _ in sequences], dtype=torch.int64)
        name = f"shard-{len(index['shards']):05d}.safetensors"
        atomic_save_file({"tokens": tokens, "loss_mask": mask, "offsets": lengths.cumsum(0)}, self.path / name)
        entry = {"file": name, "ids": ids, "num_tokens": int(tokens.numel()), "num_response_tokens": int(mask.sum())}
        if generation is not None:
            entry["generation"] = dict(generation)
        index["shards"].append(entry)
        self.write_index(index)

    def remove_stale_temporaries(self) -> None:
        """Temporary files a killed writer left behind (`specdec.files` names them `.<name>.<random>.tmp`)."""
        for pattern in (".index.json.*.tmp", ".shard-*.safetensors.*.tmp"):
            for stale in self.path.glob(pattern):
                stale.unlink(missing_ok=True)

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] long: how often each token occurs among the response tokens (loss mask 1)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for tokens, mask in self.sequences():
            counts += torch.bincount(tokens[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def sequences(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every (tokens [T] long, loss_mask [T] bool) pair, shard by shard."""
        for shard in self.read_index()["shards"]:
            data = load_file(self.path / shard["file"])
            offsets = data["offsets"].tolist()
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                yield data["tokens"][a:b].long(), data["loss_mask"][a:b].bool()


def _is_data_index(file: Path) -> bool:
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(index, dict) and isinstance(index.get("shards"), list) and "target" in index


def prepare_data_dir(out_dir: str | os.PathLike, settings: dict, overwrite: bool = False) -> DataDir:
    """Check `out_dir` before any work: a new or empty folder, or a data directory made with the same settings
    (a resume), or (with `overwrite`) a folder holding other files; then claim it. Raises SpecdecError."""
    data = DataDir(out_dir)
    ours = (data.path / OWNER_MARKER).is_file() or _is_data_index(data.index_file)
    if ours and data.exists():
        data.check_settings(data.read_index(), settings)  # read_index: a damaged index is a sentence too
    # a data directory from before the owner marker is specdec's too: claimed, not refused
    claim_output_dir(data.path, "data generate", overwrite=overwrite or ours)
    return data


def encode_user_prompt(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(text)["input_ids"])


@torch.inference_mode()
def generate_data(
    model: Any,
    tokenizer: Any,
    model_name: str,
    prompt_files: list[str],
    out_dir: str | os.PathLike,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    batch_size: int = 16,
    temperature: float = 0.0,
    limit: int | None = None,
    shuffle_seed: int = 0,
    sequences_per_shard: int = 256,
    progress: bool = True,
    flush_seconds: float = 60.0,
    overwrite: bool = False,
) -> dict:
    """Regenerate responses for every prompt not yet in `out_dir`; returns the index.

    Finished sequences reach the disk at least every `flush_seconds` (at the next finished batch) and when
    SIGINT or SIGTERM arrives, after which `Interrupted` is raised (see the module docstring)."""
    settings = generation_settings(max_new_tokens, max_prompt_tokens, temperature, model_name)
    records = [r for f in prompt_files for r in read_prompts(f)]
    random.Random(shuffle_seed).shuffle(records)  # mix sources so any prefix of the run is balanced
    data = prepare_data_dir(out_dir, settings, overwrite)
    with folder_lock(data.path, "data generate"):
        data.remove_stale_temporaries()
        if data.exists() and _is_data_index(data.index_file):
            index = data.check_target(tokenizer)
            data.check_settings(index, settings)
            files = index.setdefault("generation", {}).setdefault("prompt_files", [])
            if any(str(f) not in files for f in prompt_files):
                files.extend(str(f) for f in prompt_files if str(f) not in files)
                data.write_index(index)
        else:  # a new folder (or, with overwrite, one whose index.json was not specdec's)
            index = {"format": FORMAT_VERSION, "id_scheme": ID_SCHEME,
                     "target": {"name_or_path": model_name, "vocab_size": len(tokenizer),
                                "tokenizer_sha256": tokenizer_fingerprint(tokenizer)},
                     "generation": {**settings, "prompt_files": [str(f) for f in prompt_files],
                                    "shuffle_seed": shuffle_seed},
                     "shards": []}
            data.write_index(index)
        if index.get("id_scheme") == ID_SCHEME:
            record_id = lambda r: r.key
            unique: dict[str, PromptRecord] = {}
            for r in records:  # one example per distinct prompt text
                unique.setdefault(r.key, r)
            records = list(unique.values())
        else:  # a format 1 index: its own ids, so a resume neither repeats nor skips (module docstring)
            record_id = lambda r: r.id
        if limit is not None:
            records = records[:limit]
        done = {i for shard in index["shards"] for i in shard["ids"]}
        todo = [r for r in records if record_id(r) not in done]
        with InterruptGuard() as guard:
            _generate(model, tokenizer, data, index, settings, todo, record_id, batch_size, temperature,
                      sequences_per_shard, flush_seconds, progress, guard)
    return index


def _generate(model: Any, tokenizer: Any, data: DataDir, index: dict, settings: dict, todo: list[PromptRecord],
              record_id: Any, batch_size: int, temperature: float, sequences_per_shard: int, flush_seconds: float,
              progress: bool, guard: InterruptGuard) -> None:
    max_new_tokens, max_prompt_tokens = settings["max_new_tokens"], settings["max_prompt_tokens"]
    shard_settings = {key: settings[key] for key in SETTINGS}
    eos = model.generation_config.eos_token_id
    eos_ids = {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(sorted(eos_ids)), 0)
    device = model.get_input_embeddings().weight.device

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]generate"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
               TextColumn("{task.fields[tps]:.0f} tok/s"), TimeRemainingColumn()]
    pending_ids: list[str] = []
    pending: list[tuple[list[int], list[int]]] = []
    started, produced = time.perf_counter(), 0
    last_flush = time.monotonic()

    def flush() -> None:
        nonlocal pending_ids, pending, last_flush
        if pending:
            data.append_shard(index, pending_ids, pending, generation=shard_settings)
        pending_ids, pending = [], []
        last_flush = time.monotonic()

    try:
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("generate", total=len(todo), tps=0.0)
            # batch prompts of similar length together: less padding, less wasted compute
            encoded = [(r, encode_user_prompt(tokenizer, r.text)) for r in todo]
            encoded = [(r, ids) for r, ids in encoded if len(ids) <= max_prompt_tokens]
            bar.update(task, total=len(encoded))
            chunks = [encoded[i: i + batch_size * 8] for i in range(0, len(encoded), batch_size * 8)]
            for chunk in chunks:
                chunk.sort(key=lambda item: len(item[1]))
                for b in range(0, len(chunk), batch_size):
                    batch = chunk[b: b + batch_size]
                    width = max(len(ids) for _, ids in batch)
                    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
                    attention = torch.zeros((len(batch), width), dtype=torch.long)
                    for row, (_, ids) in enumerate(batch):
                        input_ids[row, width - len(ids):] = torch.tensor(ids)
                        attention[row, width - len(ids):] = 1
                    kwargs = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens, "pad_token_id": pad}
                    if temperature > 0:
                        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
                    with guard.interruptible():  # a signal here drops this batch and keeps the finished ones
                        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                             **kwargs)
                    for row, (record, ids) in enumerate(batch):
                        response = out[row, width:].tolist()
                        for j, tok in enumerate(response):
                            if tok in eos_ids:
                                response = response[: j + 1]
                                break
                        pending_ids.append(record_id(record))
                        pending.append((ids + response, [0] * len(ids) + [1] * len(response)))
                        produced += len(response)
                    bar.update(task, advance=len(batch), tps=produced / (time.perf_counter() - started))
                    if len(pending) >= sequences_per_shard or time.monotonic() - last_flush >= flush_seconds:
                        flush()
                    guard.check()
            flush()
    except Interrupted as stop:
        flush()  # everything that finished before the signal
        kept = sum(len(s["ids"]) for s in index["shards"])
        raise Interrupted(stop.signum, f"interrupted by {stop.signal_name}: {kept} finished sequences are saved in "
                                       f"{data.path}; run the same command again to resume.") from None

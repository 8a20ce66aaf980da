"""Target-regenerated training data: the target answers each prompt itself (the DFlash and EAGLE recipe).

On-disk format of a data directory (all of it rewritten atomically, so an interrupted run resumes cleanly):

- ``index.json``: ``{"format": 1, "target": {"name_or_path", "vocab_size", "tokenizer_sha256"},
  "generation": {...settings...}, "shards": [{"file", "ids", "num_tokens", "num_response_tokens"}]}``
- ``shard-00000.safetensors``: ``tokens`` int32 [N] (every sequence, prompt then response, concatenated),
  ``loss_mask`` uint8 [N] (1 on response tokens, the closing EOS included), ``offsets`` int64 [S + 1]
  (sequence i is ``tokens[offsets[i]:offsets[i + 1]]``).
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
from safetensors.torch import load_file, save_file

from ..errors import SpecdecError
from ..jsonl import read_jsonl

FORMAT_VERSION = 1


@dataclass
class PromptRecord:
    id: str
    text: str


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
        return json.loads(self.index_file.read_text())

    def check_target(self, tokenizer: Any) -> dict:
        index = self.read_index()
        if index["target"]["tokenizer_sha256"] != tokenizer_fingerprint(tokenizer):
            raise SpecdecError(f"The data in {self.path} was generated with another target's tokenizer "
                               f"({index['target']['name_or_path']}); regenerate it with this target.")
        return index

    def done_ids(self) -> set[str]:
        if not self.exists():
            return set()
        return {i for shard in self.read_index()["shards"] for i in shard["ids"]}

    def write_index(self, index: dict) -> None:
        tmp = self.index_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, self.index_file)

    def append_shard(self, index: dict, ids: list[str], sequences: list[tuple[list[int], list[int]]]) -> None:
        tokens = torch.tensor([t for seq, _ in sequences for t in seq], dtype=torch.int32)
        mask = torch.tensor([m for _, ms in sequences for m in ms], dtype=torch.uint8)
        lengths = torch.tensor([0] + [len(seq) for seq, _ in sequences], dtype=torch.int64)
        name = f"shard-{len(index['shards']):05d}.safetensors"
        tmp = self.path / (name + ".tmp")
        save_file({"tokens": tokens, "loss_mask": mask, "offsets": lengths.cumsum(0)}, str(tmp))
        os.replace(tmp, self.path / name)
        index["shards"].append({"file": name, "ids": ids, "num_tokens": int(tokens.numel()),
                                "num_response_tokens": int(mask.sum())})
        self.write_index(index)

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
) -> dict:
    """Regenerate responses for every prompt not yet in `out_dir`; returns the index."""
    records = [r for f in prompt_files for r in read_prompts(f)]
    random.Random(shuffle_seed).shuffle(records)  # mix sources so any prefix of the run is balanced
    if limit is not None:
        records = records[:limit]
    data = DataDir(out_dir)
    data.path.mkdir(parents=True, exist_ok=True)
    if data.exists():
        index = data.check_target(tokenizer)
    else:
        index = {"format": FORMAT_VERSION,
                 "target": {"name_or_path": model_name, "vocab_size": len(tokenizer),
                            "tokenizer_sha256": tokenizer_fingerprint(tokenizer)},
                 "generation": {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                                "temperature": temperature, "prompt_files": [str(f) for f in prompt_files],
                                "shuffle_seed": shuffle_seed},
                 "shards": []}
        data.write_index(index)
    done = data.done_ids()
    todo = [r for r in records if r.id not in done]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    device = model.get_input_embeddings().weight.device

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]generate"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
               TextColumn("{task.fields[tps]:.0f} tok/s"), TimeRemainingColumn()]
    pending_ids: list[str] = []
    pending: list[tuple[list[int], list[int]]] = []
    started, produced = time.perf_counter(), 0
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
                out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), **kwargs)
                for row, (record, ids) in enumerate(batch):
                    response = out[row, width:].tolist()
                    for j, tok in enumerate(response):
                        if tok in eos_ids:
                            response = response[: j + 1]
                            break
                    pending_ids.append(record.id)
                    pending.append((ids + response, [0] * len(ids) + [1] * len(response)))
                    produced += len(response)
                bar.update(task, advance=len(batch), tps=produced / (time.perf_counter() - started))
                if len(pending) >= sequences_per_shard:
                    data.append_shard(index, pending_ids, pending)
                    pending_ids, pending = [], []
        if pending:
            data.append_shard(index, pending_ids, pending)
    return index

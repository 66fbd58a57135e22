"""The layers stay apart: the engine's bookkeeping (scheduler, requests, block pool, KV connector)
imports neither torch nor model/, and the engine core imports no Ray (executors and servers do).
Checked in fresh interpreters where importing the forbidden package fails."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOKKEEPING = ["cluster.engine.scheduler", "cluster.engine.request", "cluster.engine.outputs",
               "cluster.engine.kv_connector", "cluster.engine.stats", "cache_service.block_pool",
               "cache_service.kv_cache_manager"]


def imports_without(blocked: list[str], modules: list[str]) -> subprocess.CompletedProcess:
    code = "import sys\n" + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
    code += "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bookkeeping_imports_without_torch_or_model():
    result = imports_without(["torch", "model"], BOOKKEEPING)
    assert result.returncode == 0, result.stderr


def test_the_sentinel_does_block_torch():
    """The check above can fail: a module that does import torch is refused the same way."""
    result = imports_without(["torch"], ["model.runner"])
    assert result.returncode != 0 and "torch" in result.stderr


def test_the_engine_core_imports_no_ray():
    engine_modules = [f"cluster.engine.{p.stem}" for p in (ROOT / "cluster/engine").glob("*.py") if p.stem != "__init__"]
    result = imports_without(["ray"], engine_modules)
    assert result.returncode == 0, result.stderr
    assert not [p.name for p in (ROOT / "cluster/engine").glob("*.py") if "import ray" in p.read_text()]


def test_an_ingress_and_a_text_models_tokenizer_load_without_torch(model_dir):
    """An ingress replica runs no model (unless it hosts the engine): torch would cost each one
    ~2.4 s of CPU to import, and its memory."""
    code = ("import sys\nimport cluster.serve.ingress\nfrom cluster.engine.tokenizer import load_tokenizer\n"
            "load_tokenizer(sys.argv[1])\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    result = subprocess.run([sys.executable, "-c", code, model_dir], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

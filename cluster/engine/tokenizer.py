"""The checkpoint's tokenizer, as transformers' AutoTokenizer picks it, loaded the shortest way that
picks the same. Every ingress replica loads one, and AutoTokenizer's own module imports torch:
~2.4 s of CPU and its memory in a process that runs no model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Text model types whose checkpoints AutoTokenizer (transformers 5) loads with the class
# tokenizer_config.json names when that is TokenizersBackend: it loads another class only for the
# model types on its list of hub classes known to be wrong (Qwen2 is on it), and for Mistral's with
# a tekken.json. tests/cluster/test_tokenizer.py checks these types against that list.
NAMED_BACKEND_TYPES = ("llama",)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(model_dir)."""
    model_dir = Path(model_dir)
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    config = _read_json(model_dir / "config.json")
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or not config:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    if tokenizer_config["tokenizer_class"] == "TokenizersBackend" and config.get("model_type") in NAMED_BACKEND_TYPES:
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_dir)
    # AutoTokenizer reads the checkpoint's config through the model's own config class, whose
    # import brings transformers' kernel hub, sympy and accelerate (~0.8 s of CPU). Where the
    # tokenizer's class is named and brings no code of its own, the pick reads only the config's
    # model_type and names, which a plain PreTrainedConfig of the same config.json holds too.
    from transformers import AutoTokenizer, PreTrainedConfig

    plain = PreTrainedConfig.from_dict(config)  # from_dict: from_pretrained warns that a `llama` config makes a plain one
    plain._name_or_path = str(model_dir)  # as AutoConfig sets it (AutoTokenizer matches it against known ids)
    return AutoTokenizer.from_pretrained(model_dir, config=plain)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}

"""The checkpoint's tokenizer, as transformers' AutoTokenizer picks it, loaded without importing the
model's own config class where that class cannot change the pick."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(model_dir). AutoTokenizer reads the checkpoint's config first,
    through the model's own config class, whose import for Llama brings transformers' kernel hub,
    sympy and accelerate: ~0.8 s of CPU in every process that loads a tokenizer (each replica, each
    `pagoda` command). Where tokenizer_config.json names the tokenizer's class and brings no code of
    its own, AutoTokenizer's pick reads only the config's model_type and names, which a plain
    PreTrainedConfig of the same config.json holds too: it is handed that one instead."""
    model_dir = Path(model_dir)
    tokenizer_file, config_file = model_dir / "tokenizer_config.json", model_dir / "config.json"
    tokenizer_config = json.loads(tokenizer_file.read_text()) if tokenizer_file.is_file() else {}
    if not (tokenizer_config.get("tokenizer_class") and "auto_map" not in tokenizer_config and config_file.is_file()):
        return AutoTokenizer.from_pretrained(model_dir)
    # from_dict: from_pretrained would warn that a `llama` config makes a plain one
    config = PreTrainedConfig.from_dict(json.loads(config_file.read_text()))
    config._name_or_path = str(model_dir)  # as AutoConfig sets it (AutoTokenizer matches it against known ids)
    return AutoTokenizer.from_pretrained(model_dir, config=config)

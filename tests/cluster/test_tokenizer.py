"""load_tokenizer (cluster/engine/tokenizer.py) gives what AutoTokenizer gives, on the default model
and on each multimodal test checkpoint: the same class, vocabulary, special tokens, template, and
the same ids for text and chats."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster.engine.tokenizer import load_tokenizer
from tests.multimodal import models

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi — ünïcode 🚀"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}],
]
TEXTS = ["The quick brown fox", "def f(x):\n    return x * 2\n", "  leading spaces and ünïcode 🚀"]


@pytest.fixture(scope="module", params=["default", "llava", "llava_next", "qwen2_audio"])
def checkpoint(request, model_dir) -> str:
    if request.param == "default":
        return model_dir
    return str(models.kept(getattr(models, f"build_{request.param}"), model_dir))


def test_load_tokenizer_is_autotokenizer(checkpoint):
    # the checkpoints name their tokenizer's class: load_tokenizer takes its short way on each
    assert json.loads((Path(checkpoint) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    ours, theirs = load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and ours.all_special_tokens == theirs.all_special_tokens
    assert ours.chat_template == theirs.chat_template
    assert [ours(t)["input_ids"] for t in TEXTS] == [theirs(t)["input_ids"] for t in TEXTS]
    for chat in CHATS:
        assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_autotokenizer_loads_the_named_backend_for_the_text_types_that_load_it_directly():
    """load_tokenizer skips AutoTokenizer (and torch) for these types: AutoTokenizer must keep
    loading the TokenizersBackend a checkpoint of theirs names."""
    from transformers.models.auto.tokenization_auto import (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
                                                            TOKENIZER_MAPPING_NAMES)

    from cluster.engine.tokenizer import NAMED_BACKEND_TYPES
    from model.config import SUPPORTED_MODEL_TYPES

    assert set(NAMED_BACKEND_TYPES) <= set(SUPPORTED_MODEL_TYPES)
    for model_type in NAMED_BACKEND_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"

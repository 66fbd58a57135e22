"""ModelConfig: what the model code needs from an HF `config.json`, checked once at load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The weight formats a runner can load a model in (model/quantization.py says what each is); here,
# with no torch import, so that the CLI and configs can name them cheaply.
QUANTIZATION_MODES = ("auto", "none", "int8", "int8-weights", "int4-weights", "int8-activations")
DTYPES = ("float32", "bfloat16", "float16")  # of the weights and of the KV cache (torch's names)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The directory is not a model Pagoda can run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir} is not a model directory: no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from None
        generation = model_dir / "generation_config.json"
        gen = json.loads(generation.read_text()) if generation.is_file() else {}
        if "text_config" in raw:  # a multimodal model: its language model is what runs here
            raw = text_config(model_dir)
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters; older files have both.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        num_heads = raw["num_attention_heads"]
        sliding_window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding_window = None
        eos = (generation_config or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding_window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window would make longer ones attend
        differently from the reference, so the window caps the length."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def text_config(model_dir: Path) -> dict:
    """The language model's config of a composite (multimodal) checkpoint, every field filled in:
    such files often leave the text config's defaults out, and only transformers knows them."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir).get_text_config().to_dict()
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(f"{model_dir}: its config.json is not one transformers can read: {e}") from None

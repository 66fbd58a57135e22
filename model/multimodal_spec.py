"""What a multimodal checkpoint takes besides text, read from its config.json: the media families
Pagoda serves. No torch here: an ingress replica reads it to check requests (the encoders, which
need torch, are model/multimodal.py's)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model.config import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class MediaFamily:
    modality: str  # what one media item of this family is: "image" or "audio"
    placeholder_key: str  # the config.json key holding the placeholder token's id
    max_items: int  # media items one request may carry


FAMILIES: dict[str, MediaFamily] = {  # by model_type
    "llava": MediaFamily("image", "image_token_index", max_items=8),
    "llava_next": MediaFamily("image", "image_token_index", max_items=4),
    "qwen2_audio": MediaFamily("audio", "audio_token_index", max_items=4),
}


@dataclass(frozen=True, slots=True)
class MultimodalSpec:
    """What a served model takes besides text (None for a text-only model; see `from_dir`)."""

    model_type: str
    modality: str
    placeholder_token_id: int
    max_items: int

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> MultimodalSpec | None:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        if "text_config" not in raw:
            return None
        model_type = raw.get("model_type")
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"multimodal model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        # transformers 5 writes image_token_id beside (or instead of) the older *_index key
        placeholder = raw.get(family.placeholder_key, raw.get(family.placeholder_key.replace("_index", "_id")))
        if placeholder is None:
            raise UnsupportedModelError(f"{model_dir}/config.json has no {family.placeholder_key}")
        return cls(model_type, family.modality, int(placeholder), family.max_items)

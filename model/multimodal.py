"""Multimodal checkpoints' encoders (which families there are, and what media each takes, is
model/multimodal_spec.py's).

The language model of a multimodal checkpoint runs like any other (model/llama.py over the paged
KV cache). Its encoder (a vision or audio tower and the projector into the language model's
hidden size) is HF's own code: the checkpoint's HF class is built on the meta device, only its
encoder modules are made real and loaded, and each media item runs through the same method the
HF model calls in its forward. What comes out is one embedding row per placeholder token, which the
language model takes in place of those tokens' embeddings (ModelRunner splices them in).

    processor output of one item (numpy) --MediaEncoder.encode--> [placeholder tokens, hidden]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from model.config import UnsupportedModelError
from model.loader import weight_files
from model.multimodal_spec import MultimodalSpec


@dataclass(frozen=True, slots=True)
class FamilyEncoder:
    modules: tuple[str, ...]  # what of the HF model encodes (modules or parameters)
    encode: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]  # HF model, one item -> rows


def _encode_image(hf: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """LLaVA's and LLaVA-NeXT's own `get_image_features` (NeXT's processor adds image_sizes)."""
    config = hf.config
    features = hf.model.get_image_features(
        **inputs, vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy)
    return torch.cat(features.pooler_output)


def _encode_qwen2_audio(hf: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """What Qwen2AudioModel.forward does to its audio before merging (it has no method of its own
    for it): the tower over the log-mel frames, masked past the clip's end, then the projector."""
    from transformers.masking_utils import create_bidirectional_mask

    model = hf.model
    features, frame_mask = inputs["input_features"], inputs["feature_attention_mask"]
    lengths, output_lengths = model.audio_tower._get_feat_extract_output_lengths(frame_mask.sum(-1))
    max_len = (features.shape[-1] - 2) // 2 + 1
    valid = (torch.arange(max_len)[None, :] < lengths[:, None]).long()
    mask = create_bidirectional_mask(config=model.audio_tower.config, inputs_embeds=torch.zeros(
        features.shape[0], max_len, 1, dtype=features.dtype), attention_mask=valid)
    hidden = model.audio_tower(features, attention_mask=mask).last_hidden_state
    projected = model.multi_modal_projector(hidden)
    return projected[0, : int(output_lengths[0])]


ENCODERS: dict[str, FamilyEncoder] = {  # by model_type, as model/multimodal_spec.py's FAMILIES
    "llava": FamilyEncoder(("model.vision_tower", "model.multi_modal_projector"), _encode_image),
    "llava_next": FamilyEncoder(("model.vision_tower", "model.multi_modal_projector", "model.image_newline"),
                                _encode_image),
    "qwen2_audio": FamilyEncoder(("model.audio_tower", "model.multi_modal_projector"), _encode_qwen2_audio),
}


class MediaEncoder:
    """The encoder of a multimodal checkpoint: one media item's processor output -> its embeddings,
    one row per placeholder token, in the language model's hidden size."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        import transformers
        from transformers import AutoConfig

        self.spec = MultimodalSpec.from_dir(model_dir)
        if self.spec is None:
            raise UnsupportedModelError(f"{model_dir} is a text-only model: it has no media encoder")
        self.dtype, self.device = dtype, torch.device(device)
        config = AutoConfig.from_pretrained(model_dir)
        architecture = getattr(transformers, config.architectures[0])
        with torch.device("meta"):  # the language model stays unallocated: model/llama.py runs it
            self.hf = architecture(config)
        self.family_encoder = ENCODERS[self.spec.model_type]
        names = self.family_encoder.modules
        for name in names:
            _materialize(self.hf, name, dtype, self.device)
        _load_encoder_weights(self.hf, model_dir, names)
        self.hf.eval()

    @torch.inference_mode()
    def encode(self, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        """One item's processor output (its arrays with a leading batch dimension of 1)."""
        tensors = {key: torch.from_numpy(np.asarray(value)).to(self.device) for key, value in inputs.items()}
        tensors = {key: t.to(self.dtype) if t.is_floating_point() else t for key, t in tensors.items()}
        return self.family_encoder.encode(self.hf, tensors)


def _materialize(hf: nn.Module, name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Allocate one encoder module (or parameter) of a model built on the meta device, with its
    buffers set the way its own HF class sets them (positions, masks): they are not in the file."""
    from transformers import PreTrainedModel

    parent_name, _, attr = name.rpartition(".")
    parent = hf.get_submodule(parent_name)
    part = getattr(parent, attr)
    if isinstance(part, nn.Parameter):
        setattr(parent, attr, nn.Parameter(torch.empty_like(part, device=device, dtype=dtype), requires_grad=False))
        return
    part.to_empty(device=device)
    part.to(dtype)
    for module in part.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    if isinstance(part, PreTrainedModel):
        part.initialize_weights()


def _load_encoder_weights(hf: nn.Module, model_dir: str | Path, names: tuple[str, ...]) -> None:
    """Checkpoints name these weights with or without the leading "model." (transformers 4 wrote
    `vision_tower.x`, 5 builds `model.vision_tower.x`): compared without it."""
    wanted = {n.removeprefix("model."): p for n, p in hf.named_parameters()
              if any(n == name or n.startswith(name + ".") for name in names)}
    loaded = set()
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                param = wanted.get(key.removeprefix("model."))
                if param is not None:
                    param.data.copy_(f.get_tensor(key))
                    loaded.add(key.removeprefix("model."))
    missing = sorted(wanted.keys() - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks encoder weights {missing[:5]}")

"""Small multimodal checkpoints of real HF architectures, written by the tests (no registry package
ships one): the language model is the real default model (SmolLM2-135M-Instruct), so answers are
real text; the encoder (vision or audio tower and projector) is a few layers, randomly
initialised with a fixed seed. Each is an ordinary HF directory (config, safetensors, processor,
chat template) that HF's own classes and Pagoda load alike.

The placeholder token is added to the tokenizer, and the vocabulary padded to a multiple of 64
with rows at the mean of the others, as LLaVA-1.5 did to Vicuna (32000 -> 32064).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

# chatml, as the default model's, with the parts of a message rendered in order
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIZE, PATCH_SIZE = 30, 6  # 25 patches: 25 placeholder tokens per image


def _language_model(lm_dir: Path, new_tokens: list[str]):
    """The default model's LM and tokenizer with the placeholder tokens added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.add_tokens(new_tokens, special_tokens=True)
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    return lm, tokenizer


def build_llava(out_dir: Path, lm_dir: Path, seed: int = 0) -> Path:
    """LlavaForConditionalGeneration: CLIP vision tower (2 layers, 30x30 images, 6x6 patches), the
    two-layer GELU projector, and SmolLM2 as the language model."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    lm, tokenizer = _language_model(lm_dir, ["<image>"])
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=lm.config, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=lm.config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(lm.model.state_dict())
    _scale_projector_output(model.model.multi_modal_projector.linear_2, lm)
    model.save_pretrained(out_dir)
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return out_dir


def _scale_projector_output(linear, lm) -> None:
    """Random projections come out ~100x smaller than the LM's token embeddings, so the image would
    barely move the answer; scaled to their norm, two images give two different answers."""
    with torch.no_grad():
        target = lm.get_input_embeddings().weight.norm(dim=-1).mean()
        probe = linear(torch.randn(256, linear.in_features))
        linear.weight.mul_(target / probe.norm(dim=-1).mean())


def png(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small random RGB image as PNG bytes."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_conversations() -> dict[str, list[dict]]:
    """The parity cases: one image, two images, an image in the second turn, and text alone."""
    return {
        "one image": [{"role": "user", "content": [
            {"type": "image", "data": png(1)}, {"type": "text", "text": "What is in this picture?"}]}],
        "two images": [{"role": "user", "content": [
            {"type": "image", "data": png(2)}, {"type": "text", "text": "and"},
            {"type": "image", "data": png(3, (24, 48))}, {"type": "text", "text": "How are these two alike?"}]}],
        "second turn": [
            {"role": "user", "content": "Hello! Can you look at pictures?"},
            {"role": "assistant", "content": "Yes, send me one."},
            {"role": "user", "content": [{"type": "text", "text": "Here:"}, {"type": "image", "data": png(4)},
                                         {"type": "text", "text": "Describe it."}]}],
        "text only": [{"role": "user", "content": "What is the capital of France?"}],
    }

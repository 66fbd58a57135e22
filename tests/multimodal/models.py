"""Small multimodal checkpoints of real HF architectures, written by the tests (no registry package
ships one): the language model is the real default model (SmolLM2-135M-Instruct), so answers are
real text; the encoder (vision or audio tower and projector) is a few layers, randomly
initialised with a fixed seed. Each is an ordinary HF directory (config, safetensors, processor,
chat template) that HF's own classes and Pagoda load alike.

The placeholder token is added to the tokenizer, and the vocabulary padded to a multiple of 64
with rows at the mean of the others, as LLaVA-1.5 did to Vicuna (32000 -> 32064).
"""

from __future__ import annotations

import functools
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
TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64)
# CLIP ViT-B/16 at 224 px (openai/clip-vit-base-patch16's tower): 196 image tokens (benchmarks)
VIT_B16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               image_size=224, patch_size=16, projection_dim=512)


def _language_model(lm_dir: Path, new_tokens: list[str]):
    """The default model's LM and tokenizer with the placeholder tokens added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.add_tokens(new_tokens, special_tokens=True)
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    old_rows = lm.get_input_embeddings().weight.shape[0]
    # Not transformers' default (rows drawn at random around the mean): the same weights every time,
    # so HF's answers for them are kept on disk from run to run (tests/hf_reference.py)
    lm.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64, mean_resizing=False)
    with torch.no_grad():
        for matrix in {lm.get_input_embeddings().weight, lm.get_output_embeddings().weight}:
            matrix[old_rows:] = matrix[:old_rows].mean(dim=0)
    return lm, tokenizer


def build_llava(out_dir: Path, lm_dir: Path, seed: int = 0, vision: dict = TINY_VISION) -> Path:
    """LlavaForConditionalGeneration: a CLIP vision tower (by default 2 layers, 30x30 images, 6x6
    patches), the two-layer GELU projector, and SmolLM2 as the language model."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    lm, tokenizer = _language_model(lm_dir, ["<image>"])
    image_size, patch_size = vision["image_size"], vision["patch_size"]
    vision = CLIPVisionConfig(**vision)
    config = LlavaConfig(vision_config=vision, text_config=lm.config, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=lm.config.tie_word_embeddings)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    return _save(out_dir, LlavaForConditionalGeneration, config, lm, processor, seed,
                 lambda model: _scale_projector_output(model.model.multi_modal_projector.linear_2, lm))


def build_llava_next(out_dir: Path, lm_dir: Path, seed: int = 0) -> Path:
    """LlavaNextForConditionalGeneration (LLaVA-1.6): the same tower, but each image is also cut
    into tiles of the grid that best fits its aspect ratio ("anyres"), their features unpadded to
    the image's shape with a learned newline embedding ending each row."""
    from transformers import (CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor)

    lm, tokenizer = _language_model(lm_dir, ["<image>"])
    vision = CLIPVisionConfig(**TINY_VISION)
    pinpoints = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE], [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]
    config = LlavaNextConfig(vision_config=vision, text_config=lm.config, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
                             vision_feature_select_strategy="default", tie_word_embeddings=lm.config.tie_word_embeddings)
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE}, image_grid_pinpoints=pinpoints,
                                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=CHAT_TEMPLATE)

    def prepare(model):
        _scale_projector_output(model.model.multi_modal_projector.linear_2, lm)
        with torch.no_grad():  # the row separator: the LM's own newline, rather than random numbers
            model.model.image_newline.copy_(lm.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("Ċ")])

    return _save(out_dir, LlavaNextForConditionalGeneration, config, lm, processor, seed, prepare)


def build_qwen2_audio(out_dir: Path, lm_dir: Path, seed: int = 0) -> Path:
    """Qwen2AudioForConditionalGeneration: its Whisper-style audio tower (2 layers over 128-bin
    log-mel frames, 4 audio tokens per 160 ms), its linear projector, and SmolLM2 as the LM."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2AudioProcessor, WhisperFeatureExtractor)

    lm, tokenizer = _language_model(lm_dir, ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    audio = Qwen2AudioEncoderConfig(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4,
                                    encoder_ffn_dim=128, d_model=64, max_source_positions=1500)
    config = Qwen2AudioConfig(audio_config=audio, text_config=lm.config,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
                                    chat_template=CHAT_TEMPLATE)

    def prepare(model):
        with torch.no_grad():  # this class keeps an LM head of its own (untied): the LM's, copied
            model.lm_head.weight.copy_(lm.get_output_embeddings().weight)
        _scale_projector_output(model.model.multi_modal_projector.linear, lm)

    return _save(out_dir, Qwen2AudioForConditionalGeneration, config, lm, processor, seed, prepare)


@functools.cache  # once a process: the key reads the weights' fingerprint and this file
def kept(build, lm_dir: str) -> Path:
    """`build`'s checkpoint (one of the builders above) from $PAGODA_HOME/test-checkpoints, written there on first use.
    Keyed by the language model's weights, this file's source and the versions of transformers and
    torch (the builds are seeded: the same key, the same bytes), so a test run reads what an earlier
    one wrote instead of building it again (~5 s of CPU a family in each pytest worker)."""
    import contextlib
    import hashlib
    import os
    import shutil
    import tempfile
    import time

    import transformers

    from cluster.model_fetch import pagoda_home
    from model.loader import weights_fingerprint

    family = build.__name__.removeprefix("build_")
    key = repr([family, weights_fingerprint(lm_dir), Path(__file__).read_bytes(), transformers.__version__,
                torch.__version__])
    home = pagoda_home() / "test-checkpoints"
    path = home / f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not path.is_dir():
        home.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=home))
        try:
            build(partial, Path(lm_dir))
            with contextlib.suppress(OSError):  # another pytest worker's, the same bytes, got there first
                os.rename(partial, path)  # whole or absent
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # a failed build's or the loser's; gone once renamed
        for stale in home.glob(f"{family}-*"):  # an earlier source's (~0.6 GB each), unless just written
            if stale != path and time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    return path


def _save(out_dir: Path, model_class, config, lm, processor, seed: int, prepare) -> Path:
    """The model of `config` with a seeded random encoder, the LM's real weights and `prepare`'s
    touches, written with its processor as an HF directory."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.model.language_model.load_state_dict(lm.model.state_dict())
    prepare(model)
    model.save_pretrained(out_dir)
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


def blank_image(fmt: str, size: tuple[int, int] = (8, 8), mode: str = "RGB") -> bytes:
    """A black image in any format PIL writes (GIF, BMP: formats the server does not take)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format=fmt)
    return buffer.getvalue()


def silence(fmt: str, seconds: float = 0.5, rate: int = 16000) -> bytes:
    """Silent audio in any format libsndfile writes (OGG: a format the server does not take)."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(rate * seconds), dtype=np.float32), rate, format=fmt)
    return buffer.getvalue()


def wav(seed: int, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A mix of two random tones with noise, as 16-bit WAV bytes."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    samples = sum(0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) for _ in range(2)) + 0.05 * rng.standard_normal(len(t))
    buffer = io.BytesIO()
    soundfile.write(buffer, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def audio_conversations() -> dict[str, list[dict]]:
    return {
        "one clip": [{"role": "user", "content": [
            {"type": "audio", "data": wav(1)}, {"type": "text", "text": "What do you hear?"}]}],
        "two clips, 8 kHz and 16 kHz": [{"role": "user", "content": [
            {"type": "audio", "data": wav(2, 0.5, 8000)}, {"type": "text", "text": "and"},
            {"type": "audio", "data": wav(3, 1.5)}, {"type": "text", "text": "Which is louder?"}]}],
        "second turn": [
            {"role": "user", "content": "Can you listen to sounds?"},
            {"role": "assistant", "content": "Yes, play me one."},
            {"role": "user", "content": [{"type": "audio", "data": wav(4)}, {"type": "text", "text": "What is it?"}]}],
    }


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

"""MediaPromptEncoder: chat messages with images or audio -> prompt token ids and media items,
exactly as the model's own HF processor makes them, after the checks each media item must pass.

    messages[i].content = [{"type": "text", "text": ...}, {"type": "image", "data": b"...", "where": ...}]
      --decode + check each item (format, bytes, pixels, seconds)--> PIL image / waveform
      --processor.apply_chat_template + processor(text, images | audio)--> token ids (placeholders
        expanded) + the processor's arrays, split per item --> MediaItem(encoder_inputs)

Media is decoded here and nowhere else; every fault of it is an InvalidRequestError naming the
part it came from ("messages[0].parts[1]") and why.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media import MediaItem, content_hash
from cluster.engine.prompt import CHAT_ROLES
from cluster.engine.sampling_params import is_valid_unicode

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
AUDIO_FORMATS = ("WAV", "FLAC")
# Keys of a processor's output that are the prompt's, not a media item's.
PROMPT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_items: int = 8  # per request (the model may allow fewer: MultimodalSpec.max_items)
    max_bytes: int = 4 << 20  # one item's encoded bytes
    max_image_pixels: int = 25_000_000  # width x height, read from the header before decoding
    max_audio_seconds: float = 30.0


def message_content(parts: list[dict]) -> str | list[dict]:
    """A message's content from its parts: the text alone when every part is text (so a text
    message takes the text path as it always has), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


class MediaPromptEncoder:
    def __init__(self, model_dir: str | Path, spec, limits: MediaLimits = MediaLimits(),
                 max_text_chars: int | None = None):
        """max_text_chars: more characters of text than the context could hold in any tokens
        (PromptEncoder.max_prompt_chars) are refused before the processor tokenizes them."""
        from transformers import AutoProcessor

        self.spec = spec  # model.multimodal.MultimodalSpec
        self.limits = limits
        self.max_text_chars = max_text_chars
        self.max_items = min(limits.max_items, spec.max_items)
        self.processor = AutoProcessor.from_pretrained(model_dir)

    def encode(self, messages: list[dict]) -> tuple[list[int], list[MediaItem]]:
        conversation, media, raw = [], [], []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of parts")
            rendered = []
            for j, part in enumerate(parts):
                where = part.get("where") or f"messages[{i}].content[{j}]"
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str) or not is_valid_unicode(part["text"]):
                        raise InvalidRequestError(where, "must be valid Unicode text")
                    rendered.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "audio"):
                    if kind != self.spec.modality:
                        raise InvalidRequestError(where, f"this model takes {self.spec.modality}, not {kind}")
                    if len(media) == self.max_items:
                        raise InvalidRequestError(where, f"more than {self.max_items} media items; this model allows at most {self.max_items}")
                    data = part.get("data")
                    media.append(self._decode(kind, data, where))
                    raw.append((kind, data, where))
                    rendered.append({"type": kind, kind: ""})  # what chat templates test for
                else:
                    raise InvalidRequestError(where, "must be a text, image or audio part")
            conversation.append({"role": message["role"], "content": rendered})
        num_chars = sum(len(p["text"]) for m in conversation for p in m["content"] if p["type"] == "text")
        if self.max_text_chars is not None and num_chars > self.max_text_chars:
            raise InvalidRequestError("messages", f"have {num_chars} characters of text, more than the context can hold")
        try:
            text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may raise on roles or orders it does not allow
            raise InvalidRequestError("messages", f"the chat template rejected them: {e}") from None
        return self.process(text, media, raw)

    def process(self, text: str, media: list, raw: list[tuple[str, bytes, str]]) -> tuple[list[int], list[MediaItem]]:
        """The processor over the rendered prompt and the decoded media; one MediaItem per item."""
        kwargs = {}
        if media:
            kwargs["images" if self.spec.modality == "image" else "audio"] = media
        if self.spec.modality == "audio" and media:
            kwargs["sampling_rate"] = self.sampling_rate
        try:
            out = self.processor(text=text, return_tensors="np", **kwargs)
        except ValueError as e:  # e.g. a placeholder spelt in the text: more placeholders than media
            raise InvalidRequestError("messages", f"the model's processor refused them: {e}") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        prompt_keys = {*PROMPT_KEYS, *getattr(self.processor, "unused_input_names", ())}
        items = [
            MediaItem(kind, content_hash(kind, data),
                      {key: np.ascontiguousarray(value[k : k + 1]) for key, value in out.items() if key not in prompt_keys},
                      where=where)
            for k, (kind, data, where) in enumerate(raw)
        ]
        return token_ids, items

    @property
    def sampling_rate(self) -> int:
        return self.processor.feature_extractor.sampling_rate

    def _decode(self, kind: str, data, where: str):
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise InvalidRequestError(where, f"has no {kind} bytes")
        if len(data) > self.limits.max_bytes:
            raise InvalidRequestError(where, f"is {len(data)} bytes; this server takes {kind}s of at most {self.limits.max_bytes}")
        return decode_image(data, where, self.limits) if kind == "image" else decode_audio(
            data, where, self.limits, self.sampling_rate)


def decode_image(data: bytes, where: str, limits: MediaLimits):
    """An RGB PIL image, or InvalidRequestError: not an image, a format not taken, more pixels
    than the cap (checked from the header, before the pixels are decoded), a truncated file."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InvalidRequestError(where, f"is not an image (taken: {', '.join(IMAGE_FORMATS)})") from None
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(where, f"is too large an image: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:  # a header cut short or corrupt
        raise InvalidRequestError(where, f"is a damaged image: {e}") from None
    if image.format not in IMAGE_FORMATS:
        raise InvalidRequestError(where, f"is a {image.format} image; taken: {', '.join(IMAGE_FORMATS)}")
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise InvalidRequestError(
            where, f"is {width}x{height} pixels; this server takes images of at most {limits.max_image_pixels} pixels")
    if width == 0 or height == 0:
        raise InvalidRequestError(where, "is an image with no pixels")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise InvalidRequestError(where, f"is a damaged {image.format} image: {e}") from None
    return image.convert("RGB")


def decode_audio(data: bytes, where: str, limits: MediaLimits, sampling_rate: int) -> np.ndarray:
    """Mono float32 samples at the feature extractor's rate, or InvalidRequestError: not audio, a
    format not taken, longer than the cap (from the header), damaged. (A WAV cut short is read
    as the samples it holds: its header does not say otherwise to libsndfile.)"""
    import soundfile
    import soxr

    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError):
        raise InvalidRequestError(where, f"is not audio (taken: {', '.join(AUDIO_FORMATS)})") from None
    if info.format not in AUDIO_FORMATS:
        raise InvalidRequestError(where, f"is {info.format} audio; taken: {', '.join(AUDIO_FORMATS)}")
    if info.frames / info.samplerate > limits.max_audio_seconds:
        raise InvalidRequestError(
            where, f"is {info.frames / info.samplerate:.1f} s of audio; this server takes at most {limits.max_audio_seconds:g} s")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as e:
        raise InvalidRequestError(where, f"is damaged {info.format} audio: {e}") from None
    if len(samples) == 0:
        raise InvalidRequestError(where, "is audio with no samples")
    if len(samples) < info.frames:
        raise InvalidRequestError(where, f"is damaged {info.format} audio: {len(samples)} of its {info.frames} frames read")
    mono = samples.mean(axis=1)
    if rate != sampling_rate:
        mono = soxr.resample(mono, rate, sampling_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)

"""Multimodal checkpoints kept on disk (tests/multimodal/models.py) and HF's answers
for them: HF's own model class, processor and chat template on the same directory (the answers
kept on disk like the text oracle's, tests/hf_reference.py)."""

from __future__ import annotations

import io

import pytest
import torch

from tests.hf_reference import Reference, kept_on_disk
from tests.multimodal import models

MAX_TOKENS = 16  # of every greedy answer compared with HF's

# family -> (how the test writes it, its HF class, the conversations its parity is checked on)
FAMILIES = {
    "llava": (models.build_llava, "LlavaForConditionalGeneration", models.image_conversations),
    "llava_next": (models.build_llava_next, "LlavaNextForConditionalGeneration", models.image_conversations),
    "qwen2_audio": (models.build_qwen2_audio, "Qwen2AudioForConditionalGeneration", models.audio_conversations),
}


class Checkpoints:
    """Each family's directory, written on first use; HF's greedy answers likewise."""

    def __init__(self, lm_dir: str):
        self.lm_dir = str(lm_dir)
        self._references: dict[str, dict[str, Reference]] = {}

    def dir(self, family: str) -> str:
        return str(models.kept(FAMILIES[family][0], self.lm_dir))

    def references(self, family: str) -> dict[str, Reference]:
        if family not in self._references:
            import transformers

            _, class_name, conversations = FAMILIES[family]
            asked = conversations()

            def compute() -> list[Reference]:
                oracle = HFMultimodalOracle(getattr(transformers, class_name), self.dir(family))
                return [oracle.greedy(c, MAX_TOKENS) for c in asked.values()]

            answers = kept_on_disk(self.dir(family), [class_name, list(asked.items()), MAX_TOKENS], compute)
            self._references[family] = dict(zip(asked, answers))
        return self._references[family]


@pytest.fixture(scope="session")
def checkpoints(model_dir) -> Checkpoints:
    return Checkpoints(model_dir)


@pytest.fixture(scope="session")
def llava_dir(checkpoints) -> str:
    return checkpoints.dir("llava")


@pytest.fixture(scope="session")
def llava_references(checkpoints) -> dict[str, Reference]:
    return checkpoints.references("llava")


class HFMultimodalOracle:
    """Greedy answers of the HF model class to conversations whose content parts are
    {"type": "text", "text"} or {"type": "image" | "audio", "data": file bytes}."""

    def __init__(self, model_class, model_dir: str):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, conversation: list[dict], max_new_tokens: int) -> Reference:
        from PIL import Image

        media, messages = [], []
        for message in conversation:
            content = message["content"]
            if isinstance(content, list):
                for part in content:
                    if part["type"] == "image":
                        media.append(Image.open(io.BytesIO(part["data"])).convert("RGB"))
                    elif part["type"] == "audio":
                        media.append(_waveform(part["data"], self.processor.feature_extractor.sampling_rate))
                content = [{"type": p["type"]} if p["type"] != "text" else p for p in content]
            messages.append({"role": message["role"], "content": content})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kind = "audio" if hasattr(self.processor, "feature_extractor") else "images"
        extra = {"sampling_rate": self.processor.feature_extractor.sampling_rate} if kind == "audio" else {}
        inputs = self.processor(text=text, return_tensors="pt", **{kind: media or None}, **extra)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        gaps = [(lambda top: (top[0] - top[1]).item())(logits[0].float().topk(2).values) for logits in out.logits]
        return Reference(tokens, gaps)


def _waveform(data: bytes, rate: int):
    """Mono samples at the model's rate: librosa's way of loading (soundfile, then soxr's resampler)."""
    import soundfile
    import soxr

    samples, source_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    return soxr.resample(mono, source_rate, rate) if source_rate != rate else mono

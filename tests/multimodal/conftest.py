"""Multimodal checkpoints written once per session (tests/multimodal/models.py) and HF's answers
for them: HF's own model class, processor and chat template on the same directory."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.hf_reference import Reference

MAX_TOKENS = 16  # of every greedy answer compared with HF's


@pytest.fixture(scope="session")
def llava_dir(model_dir, tmp_path_factory) -> str:
    from tests.multimodal.models import build_llava

    return str(build_llava(tmp_path_factory.mktemp("llava"), Path(model_dir)))


@pytest.fixture(scope="session")
def llava_oracle(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return HFMultimodalOracle(LlavaForConditionalGeneration, llava_dir)


@pytest.fixture(scope="session")
def llava_references(llava_oracle) -> dict[str, Reference]:
    from tests.multimodal.models import image_conversations

    return {name: llava_oracle.greedy(c, MAX_TOKENS) for name, c in image_conversations().items()}


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
                content = [{"type": p["type"]} if p["type"] != "text" else p for p in content]
            messages.append({"role": message["role"], "content": content})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=text, images=media or None, return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        gaps = [(lambda top: (top[0] - top[1]).item())(logits[0].float().topk(2).values) for logits in out.logits]
        return Reference(tokens, gaps)

"""Small builders for engine-side unit tests."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.request import Request
from cluster.engine.sampling_params import SamplingParams
from model.config import ModelConfig
from model.runner import kv_bytes_per_block

_WORDS = ["<eos>"] + [f"w{i}" for i in range(200)]


def word_tokenizer() -> Tokenizer:
    """Token i decodes to ' w{i-1}'; token 0 is <eos>."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def make_request(
    request_id: str, num_prompt_tokens: int, max_tokens: int = 16, first_token: int = 1,
    tenant: str | None = None, weight: float = 1.0, **params
) -> Request:
    """Prompts are runs of consecutive ids from first_token: equal first_token, shared prefix."""
    prompt = [1 + (first_token - 1 + i) % 150 for i in range(num_prompt_tokens)]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return Request(
        request_id=request_id,
        parent_id=request_id,
        index=0,
        prompt_token_ids=prompt,
        params=sampling,
        detokenizer=IncrementalDetokenizer(word_tokenizer(), prompt, sampling.stop),
        eos_token_ids=(0,),
        max_model_len=4096,
        tenant=tenant,
        weight=weight,
    )


def block_bytes(model_dir) -> int:
    """One block's KV in bytes (fp32, 16 tokens), for the model in model_dir."""
    c = ModelConfig.from_dir(model_dir)
    return kv_bytes_per_block(c, c.num_key_value_heads, 16, torch.float32)

"""Perplexity of the engine's model on offline text (Python's documentation topics) for each
weight format (model/quantization.py: dense fp32, auto, dynamic int8, weight-only int8 / int4)
and KV cache dtype (kv_cache_dtype), through Pagoda's own ModelRunner (paged attention, chunked in
windows), with HF transformers on the same windows as the reference.

    python -m benchmarks.perplexity [--tokens 8192] [--window 1024] [--modes auto,none,...]
                                    [--kv-cache-dtypes auto,bfloat16] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from transformers import AutoTokenizer

from cluster.model_fetch import fetch_default_model
from model.config import QUANTIZATION_MODES
from model.loader import parse_dtype
from cluster.engine.executor import SequenceInput
from model.runner import ModelRunner
from tests.parity_prompts import long_document


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], window: int) -> float:
    """Mean negative log-likelihood over independent windows, each prefilled in one step."""
    nll, count = 0.0, 0
    blocks = list(range(-(-window // runner.block_size)))
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        step = runner.prepare([SequenceInput(chunk[:-1], 0, blocks, None)])
        step.sample_rows = torch.arange(len(chunk) - 1)
        logprobs = torch.log_softmax(runner.forward(step), dim=-1)
        targets = torch.tensor(chunk[1:])
        nll -= logprobs[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return math.exp(nll / count)


@torch.inference_mode()
def hf_perplexity(model_dir: str, token_ids: list[int], window: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logprobs = torch.log_softmax(hf(torch.tensor([chunk[:-1]])).logits[0].float(), dim=-1)
        nll -= logprobs[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].sum().item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--modes", default=",".join(QUANTIZATION_MODES), help="weight formats to measure")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="KV cache dtypes to measure each format with")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF fp32 reference")
    args = parser.parse_args()
    # (result name, weight format, KV cache dtype or None for the model's)
    runs = [(mode if kv == "auto" else f"{mode}+kv-{kv}", mode, None if kv == "auto" else parse_dtype(kv))
            for mode in args.modes.split(",") for kv in args.kv_cache_dtypes.split(",")]
    model_dir = args.model or str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer(long_document(args.tokens * 5, start=20))["input_ids"][: args.tokens]
    results = {"date": time.strftime("%Y-%m-%d"), "tokens": len(token_ids), "window": args.window}
    for name, quantization, kv_cache_dtype in runs:
        runner = ModelRunner(model_dir, num_blocks=-(-args.window // 16), quantization=quantization,
                             kv_cache_dtype=kv_cache_dtype)
        results[name] = perplexity(runner, token_ids, args.window)
        results[f"{name}_weights"] = runner.weight_formats
        print(name, results[name], runner.weight_formats, flush=True)
    if not args.no_hf:
        results["hf_fp32"] = hf_perplexity(model_dir, token_ids, args.window)
        for name, _, _ in runs:
            results[f"{name}_vs_hf_fp32"] = results[name] / results["hf_fp32"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

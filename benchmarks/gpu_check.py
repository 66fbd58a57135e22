"""GPU check, one short command for a session that is lent a GPU (about 3-4 minutes on an H200):

    python -m benchmarks.gpu_check --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--out result.json]

1. parity: greedy answers to the parity prompts (tests/parity_prompts.py, 24 tokens each), HF
   transformers on the GPU vs Pagoda's engine on the GPU, token for token (near-ties allowed as
   in the CPU tests);
2. step time: Pagoda decode steps at batch 1, 32 and 128, CUDA-synchronized: fp32 and bf16 on
   the torch attention path (gathered blocks), and bf16 on FlashInfer's paged kernels where
   flashinfer-python is installed (model/attention_flashinfer.py), each with the path it took;
3. attention: the parity prompts' greedy answers in bf16, FlashInfer vs the torch path (bf16
   rounding may part them at a near-tie; the count of equal answers is reported);
4. TP=2 over NCCL (two Ray worker actors, one GPU each) when the machine has two GPUs and Ray:
   its greedy answers equal TP=1's. Skipped, and said so, otherwise.

Prints one JSON object (and writes it to --out). The default model is dequantized from the GGUF
into $PAGODA_HOME (a temporary one if unset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a quick dry run of this script")
    parser.add_argument("--quick", action="store_true", help="3 prompts, batches 1 and 4 (dry runs)")
    args = parser.parse_args()
    os.environ.setdefault("PAGODA_HOME", tempfile.mkdtemp(prefix="pagoda-gpu-"))
    from cluster.model_fetch import fetch_default_model

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    else:
        report = {"device": DEVICE, "gpus": 0}
    report["torch"] = torch.__version__
    t0 = time.perf_counter()
    model_dir = str(fetch_default_model(log=lambda m: None, gguf_path=args.gguf))
    report["model_prepare_s"] = round(time.perf_counter() - t0, 1)

    report["parity"] = parity(model_dir, 3 if args.quick else None)
    batches = (1, 4) if args.quick else (1, 32, 128)
    report["decode_step_ms"] = step_times(model_dir, batches)
    report["flashinfer_vs_torch_bf16"] = attention_paths_agree(model_dir, 3 if args.quick else None)
    report["hf_decode"] = hf_decode_rates(model_dir, batches)
    report["tp2_nccl"] = tp2(model_dir, report["gpus"])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def parity(model_dir: str, num_prompts: int | None) -> dict:
    from transformers import AutoModelForCausalLM

    from cluster import LLM, SamplingParams
    from tests.hf_reference import compare

    llm = LLM(model_dir, device=DEVICE, num_blocks=2048)
    encoded = _parity_prompt_ids(llm, num_prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    references = [_hf_greedy(hf, ids, 24) for ids in encoded]
    outputs = llm.generate(encoded, SamplingParams(max_tokens=24, temperature=0))
    verdicts = []
    for out, ref in zip(outputs, references):
        try:
            verdicts.append(compare(out.outputs[0].token_ids, ref))
        except AssertionError as e:
            verdicts.append(f"DIFFERENT: {e}")
    del hf, llm
    return {"prompts": len(verdicts), "equal": verdicts.count("equal"), "near_tie": verdicts.count("near-tie"),
            "different": [v for v in verdicts if v.startswith("DIFFERENT")]}


def _parity_prompt_ids(llm, num_prompts: int | None) -> list[list[int]]:
    from tests.parity_prompts import parity_prompts

    return [llm.engine.encode_prompt(p.get("prompt"), p.get("messages")) for p in parity_prompts()[:num_prompts]]


@torch.inference_mode()
def _hf_greedy(hf, prompt_ids, max_new_tokens):
    """tests.hf_reference.hf_greedy, with the inputs on the model's device."""
    from tests.hf_reference import Reference

    out = hf.generate(torch.tensor([prompt_ids], device=DEVICE),
                      attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=DEVICE),
                      max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    gaps = [(lambda t: (t[0] - t[1]).item())(logits[0].float().topk(2).values) for logits in out.logits]
    return Reference(out.sequences[0, len(prompt_ids):].tolist(), gaps)


def attention_path(flashinfer: bool):
    """LLMs made inside take FlashInfer where they can (True) or the torch path (False)."""
    from model.attention_flashinfer import SWITCH

    return mock.patch.dict(os.environ, {SWITCH: "1" if flashinfer else "0"})


def _attention(llm) -> str:
    return llm.engine.executor.describe()[0]["attention"]


def attention_paths_agree(model_dir: str, num_prompts: int | None) -> dict:
    from cluster import LLM, SamplingParams

    answers, paths = [], []
    for flashinfer in (False, True):
        with attention_path(flashinfer):
            llm = LLM(model_dir, device=DEVICE, dtype="bfloat16", num_blocks=2048)
        prompts = _parity_prompt_ids(llm, num_prompts)
        answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))])
        paths.append(_attention(llm))
        del llm
    return {"paths": paths, "prompts": len(answers[0]), "equal": sum(a == b for a, b in zip(*answers))}


def step_times(model_dir: str, batches: tuple[int, ...]) -> dict:
    from cluster import LLM, SamplingParams

    results = {}
    for dtype, flashinfer in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        with attention_path(flashinfer):
            llm = LLM(model_dir, device=DEVICE, dtype=dtype, num_blocks=4096, max_num_seqs=128)
        path = _attention(llm)
        engine = llm.engine
        for batch in batches:
            params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"b{batch}-{i}", list(range(100 + i, 228 + i)), params)  # 128-token prompts
            while (stats := engine.stats()).num_waiting or stats.num_prefilling:
                engine.step()
            times = []
            for _ in range(30):
                _sync()
                t = time.perf_counter()
                engine.step()
                _sync()
                times.append(time.perf_counter() - t)
            for i in range(batch):
                engine.abort_request(f"b{batch}-{i}")
            median = statistics.median(times[5:])
            results[f"{dtype}_{'flashinfer' if flashinfer else 'torch'}_batch{batch}"] = {
                "attention": path, "step_ms": round(median * 1e3, 2), "tok_per_s": round(batch / median, 1)}
        del llm
    return results


@torch.inference_mode()
def hf_decode_rates(model_dir: str, batches: tuple[int, ...]) -> dict:
    """The peer: HF transformers' generate on a static batch of 128-token prompts; decode tok/s
    from the time of 65 new tokens minus the time of 1 (the prefill)."""
    from transformers import AutoModelForCausalLM

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
        for batch in batches:
            ids = torch.arange(100, 228, device=DEVICE).repeat(batch, 1) + torch.arange(batch, device=DEVICE)[:, None]

            def run(new_tokens: int, model=hf, ids=ids) -> float:
                _sync()
                t = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False)
                _sync()
                return time.perf_counter() - t

            run(2)  # warm-up
            prefill = statistics.median(run(1) for _ in range(3))
            full = statistics.median(run(65) for _ in range(3))
            step = (full - prefill) / 64
            name = str(dtype).removeprefix("torch.")
            results[f"{name}_batch{batch}"] = {"step_ms": round(step * 1e3, 2), "tok_per_s": round(batch / step, 1)}
        del hf
    return results


def tp2(model_dir: str, gpus: int) -> dict:
    if gpus < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {gpus}"}
    try:
        import ray
    except ImportError:
        return {"skipped": "ray is not installed here"}
    from cluster import LLM, SamplingParams

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a small robot"]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    one = [o.outputs[0].token_ids for o in LLM(model_dir, device="cuda", num_blocks=256).generate(prompts, greedy)]
    two_llm = LLM(model_dir, device="cuda", num_blocks=256, tensor_parallel_size=2)
    two = [o.outputs[0].token_ids for o in two_llm.generate(prompts, greedy)]
    ranks = two_llm.engine.executor.describe()
    two_llm.shutdown()
    ray.shutdown()
    return {"equal_to_tp1": one == two, "ranks": ranks}


if __name__ == "__main__":
    main()

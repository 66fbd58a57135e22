"""GPU check, one short command for a session that is lent a GPU (about 3-4 minutes on an H200):

    python -m benchmarks.gpu_check --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--out result.json] [--sections a,b]

1. parity: greedy answers to the parity prompts (tests/parity_prompts.py, 24 tokens each), HF
   transformers on the GPU vs Pagoda's engine on the GPU, token for token (near-ties allowed as
   in the CPU tests);
2. step time: Pagoda decode steps at batch 1, 32 and 128 (128-token prompts) and at batch 32
   with 2,048 tokens of context, CUDA-synchronized: fp32 and bf16 on the torch attention path
   (gathered blocks), and bf16 on FlashInfer's paged kernels where flashinfer-python is
   installed (model/attention_flashinfer.py), each with the path it took; HF transformers'
   static-batch decode at the same batches as the peer;
3. attention: the parity prompts' greedy answers in bf16 on FlashInfer and on the torch path,
   each against HF transformers in bf16, with the output token and HF's top-2 logit gap where
   one parts from HF (bf16 rounding parts answers at near-ties);
4. TP=2 over NCCL (two Ray worker actors, one GPU each) when the machine has two GPUs and Ray:
   its greedy answers equal TP=1's. Skipped, and said so, otherwise.

Prints one JSON object and writes it to --out after each section, so a run cut short keeps what it
measured; a section that fails records its error and the next one runs. The default model is dequantized from the GGUF
into $PAGODA_HOME (a temporary one if unset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a quick dry run of this script")
    parser.add_argument("--quick", action="store_true", help="3 prompts, batches 1 and 4 (dry runs)")
    parser.add_argument("--sections", default=None, help="a comma list of the report's section names (default: all)")
    args = parser.parse_args()
    os.environ.setdefault("PAGODA_HOME", tempfile.mkdtemp(prefix="pagoda-gpu-"))
    from cluster.model_fetch import fetch_default_model

    global DEVICE
    DEVICE = args.device
    batches = (1, 4) if args.quick else (1, 32, 128)
    # 128-token prompts at each batch, and one long context, where gathering blocks costs most
    cases = tuple((batch, 128) for batch in batches) + (((4, 512),) if args.quick else ((32, 2048),))
    num_prompts = 3 if args.quick else None
    model_dir, report = None, {}  # set below; the sections run after
    sections = {
        "parity": lambda: parity(model_dir, num_prompts),
        "decode_step_ms": lambda: step_times(model_dir, cases, flashinfer=False),
        "hf_decode": lambda: hf_decode_rates(model_dir, cases),
        "decode_step_ms_flashinfer": lambda: step_times(model_dir, cases, flashinfer=True),
        "flashinfer_vs_torch_bf16": lambda: attention_paths_agree(model_dir, num_prompts),
        "tp2_nccl": lambda: tp2(model_dir, report["gpus"]),
    }
    chosen = args.sections.split(",") if args.sections else list(sections)
    if unknown := set(chosen) - set(sections):
        parser.error(f"--sections: unknown {sorted(unknown)}; the sections are {list(sections)}")

    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        report.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    else:
        report.update(device=DEVICE, gpus=0)
    report["torch"] = torch.__version__
    t0 = time.perf_counter()
    model_dir = str(fetch_default_model(log=lambda m: None, gguf_path=args.gguf))
    report["model_prepare_s"] = round(time.perf_counter() - t0, 1)
    for name in chosen:  # each one's result (or error) is kept as it comes
        section = sections[name]
        t0 = time.perf_counter()
        try:
            report[name] = section()
        except Exception as e:  # a later section can still run; the report says what broke
            report[name] = {"error": f"{type(e).__name__}: {e}", "at": traceback.format_exc(limit=-3)}
        report.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


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
    """bf16: the parity prompts' greedy answers on the torch path and on FlashInfer, each against HF
    transformers in bf16. Where one parts from HF: at which output token, and HF's top-2 logit gap
    there (bf16 rounding parts answers only where that gap is small)."""
    from transformers import AutoModelForCausalLM

    from cluster import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    answers, result, references = [], {}, None
    for flashinfer in (False, True):
        with attention_path(flashinfer):
            llm = LLM(model_dir, device=DEVICE, dtype="bfloat16", num_blocks=2048)
        prompts = _parity_prompt_ids(llm, num_prompts)
        references = references or [_hf_greedy(hf, ids, 24) for ids in prompts]
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))]
        partings = [_parting(ours, ref) for ours, ref in zip(outputs, references)]
        result["flashinfer" if flashinfer else "torch"] = {
            "attention": _attention(llm), "equal_to_hf_bf16": partings.count(None),
            "parted_at_token_with_hf_gap": [p for p in partings if p]}
        answers.append(outputs)
        del llm
    del hf
    return {"prompts": len(answers[0]), "paths_equal": sum(a == b for a, b in zip(*answers)), **result}


def _parting(ours: list[int], ref) -> tuple[int, float] | None:
    """(output token, HF's top-2 gap there) where ours first differs from HF's; None if equal."""
    from tests.hf_reference import first_difference

    step = first_difference(ours, ref)
    return None if step is None else (step, round(ref.top2_gaps[step], 4))


def step_times(model_dir: str, cases: tuple[tuple[int, int], ...], flashinfer: bool) -> dict:
    """Decode step time for each (batch, prompt tokens) case, CUDA-synchronized."""
    from benchmarks.decode_batch import blocks_per_request, decoding_batch
    from cluster import LLM

    steps, block_size, chunk = 30, 16, 512
    num_blocks = max(batch * blocks_per_request(batch, prompt_len, steps, chunk, block_size)
                     for batch, prompt_len in cases) + 64
    results = {}
    for dtype in ("bfloat16",) if flashinfer else ("float32", "bfloat16"):
        with attention_path(flashinfer):
            llm = LLM(model_dir, device=DEVICE, dtype=dtype, num_blocks=num_blocks, block_size=block_size,
                      max_num_seqs=max(batch for batch, _ in cases), max_num_batched_tokens=chunk)
        path = _attention(llm)
        engine = llm.engine
        for batch, prompt_len in cases:
            prompts = [list(range(100 + i, 100 + i + prompt_len)) for i in range(batch)]
            times = []
            with decoding_batch(engine, prompts, steps, tag=f"b{batch}-{prompt_len}"):
                for _ in range(steps):
                    _sync()
                    t = time.perf_counter()
                    engine.step()
                    _sync()
                    times.append(time.perf_counter() - t)
            median = statistics.median(times[5:])
            results[f"{dtype}_{'flashinfer' if flashinfer else 'torch'}_batch{batch}_ctx{prompt_len}"] = {
                "attention": path, "step_ms": round(median * 1e3, 2), "tok_per_s": round(batch / median, 1)}
        del llm
    return results


@torch.inference_mode()
def hf_decode_rates(model_dir: str, cases: tuple[tuple[int, int], ...]) -> dict:
    """The peer: HF transformers' generate on a static batch of each case's prompts; decode tok/s
    from the time of 65 new tokens minus the time of 1 (the prefill)."""
    from transformers import AutoModelForCausalLM

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
        for batch, prompt_len in cases:
            offsets = torch.arange(batch, device=DEVICE)[:, None]
            ids = torch.arange(100, 100 + prompt_len, device=DEVICE).repeat(batch, 1) + offsets

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
            results[f"{name}_batch{batch}_ctx{prompt_len}"] = {"step_ms": round(step * 1e3, 2), "tok_per_s": round(batch / step, 1)}
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

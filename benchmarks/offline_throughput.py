"""Offline throughput: Pagoda's engine vs HF transformers, same prompts, same machine, one run.

    python benchmarks/offline_throughput.py [--num-prompts 32] [--max-tokens 128]

Measures
  * Pagoda: all prompts submitted at once, continuous batching (output tok/s, wall clock incl. prefill)
  * HF sequential: one prompt at a time with model.generate (a subset; tok/s is a rate)
  * HF static batch: all prompts in one left-padded batch with model.generate
  * engine step vs bare forward: median time of a full engine step on a decode batch of all
    prompts, vs the model forward + LM head alone on the very same batch tensors
Every request generates exactly --max-tokens tokens (ignore_eos) so all three do the same work.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster import LLM, SamplingParams
from cluster.model_fetch import fetch_default_model

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
    "Give me three tips for learning Python.", "What causes rain?", "Describe a cat to a child.",
    "Why is the sky blue?", "Name five fruits.", "What is photosynthesis?", "Tell me a joke.",
    "How do airplanes fly?", "What is a prime number?", "Summarize the plot of Cinderella.",
    "What does a CPU do?", "How do I boil an egg?", "What is the speed of light?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else " Answer in detail.")
        prompts.append(list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]))
    return prompts


def bench_pagoda(model_dir, prompts, max_tokens, fixed_length, quantization=None):
    llm = LLM(model_dir, max_num_seqs=len(prompts), quantization=quantization)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=fixed_length)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": num_tokens, "output_tok_s": num_tokens / elapsed}, llm


def bench_step_vs_execute(llm, prompts, num_steps=20):
    """Run all prompts to the decode phase, then time engine steps: whole, and the executor's part
    of each (the model and sampling); the rest is the engine's own work (plan, inputs, update)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while (stats := engine.stats()).num_waiting or stats.num_prefilling:
        engine.step()
    step_times, execute_times = [], []
    for _ in range(num_steps):
        engine.step()
        stats = engine.stats()
        step_times.append(stats.last_step_s)
        execute_times.append(stats.last_execute_s)
    for i in range(len(prompts)):
        engine.abort_request(f"s{i}")
    step, execute = statistics.median(step_times), statistics.median(execute_times)
    return {"batch": len(prompts), "step_ms": step * 1e3, "execute_ms": execute * 1e3, "ratio": step / execute}


def bench_hf_sequential(hf, prompts, max_tokens, fixed_length):
    start, num_tokens = time.perf_counter(), 0
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens if fixed_length else 0, do_sample=False)
        num_tokens += out.shape[1] - len(p)
    elapsed = time.perf_counter() - start
    return {"prompts": len(prompts), "seconds": elapsed, "output_tokens": num_tokens, "output_tok_s": num_tokens / elapsed}


def bench_hf_static(hf, tokenizer, prompts, max_tokens, fixed_length):
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens if fixed_length else 0, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    # Useful tokens only: a finished row keeps producing padding until the longest one ends.
    num_tokens = sum(_useful_length(row[width:].tolist(), hf.generation_config.eos_token_id) for row in out)
    return {"batch": len(prompts), "seconds": elapsed, "output_tokens": num_tokens, "output_tok_s": num_tokens / elapsed}


def _useful_length(tokens: list[int], eos) -> int:
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "nproc": nproc, "torch": torch.__version__, "threads": torch.get_num_threads()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-sequential-prompts", type=int, default=4, help="HF one-at-a-time is slow: a subset")
    parser.add_argument("--natural-stop", action="store_true",
                        help="stop at EOS (lengths vary) instead of exactly --max-tokens per request")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fixed = not args.natural_stop
    model_dir = args.model or str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, args.num_prompts)

    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "num_prompts": len(prompts),
               "max_tokens": args.max_tokens, "workload": "fixed-length" if fixed else "natural-stop",
               "mean_prompt_tokens": statistics.mean(map(len, prompts))}
    for quantization in (None, "int8"):
        name = f"pagoda_{quantization or 'fp32'}"
        results[name], llm = bench_pagoda(model_dir, prompts, args.max_tokens, fixed, quantization)
        print(name, results[name], flush=True)
        results[f"step_vs_execute_{quantization or 'fp32'}"] = bench_step_vs_execute(llm, prompts)
        print("step vs execute", results[f"step_vs_execute_{quantization or 'fp32'}"], flush=True)
        del llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        results["hf_sequential"] = bench_hf_sequential(hf, prompts[: args.hf_sequential_prompts], args.max_tokens, fixed)
        print("hf sequential", results["hf_sequential"], flush=True)
        results["hf_static_batch"] = bench_hf_static(hf, tokenizer, prompts, args.max_tokens, fixed)
        print("hf static", results["hf_static_batch"], flush=True)
    results["ratios"] = {
        f"{name}_vs_{peer}": results[name]["output_tok_s"] / results[peer]["output_tok_s"]
        for name in ("pagoda_fp32", "pagoda_int8") for peer in ("hf_sequential", "hf_static_batch")
    }
    print(json.dumps(results, indent=2))
    out = Path(args.out or f"benchmarks/results/offline_throughput_{results['workload']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""What a grammar costs per decode step at batch 32: the same 32 decoding requests with and without
a JSON schema, on one LLMEngine of the default model, in one session.

    python -m benchmarks.structured_output_cost [--batch 32] [--steps 40]

The schema is an object holding one array of 100 to 200 strings, so every request stays in the
grammar's middle and keeps decoding for the whole measurement; once with the strings free, once
bounded (maxLength 12), which xgrammar cannot serve from its cached token masks. Reported: the median decode
step with and without the schema, and the grammar's own parts timed alone on the step's shapes:
filling the 32 bitmask rows (xgrammar matchers, on the engine thread) and applying them to the
[32, vocab] logits (one batched call in the sampler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_output import StructuredOutput
from cluster.model_fetch import fetch_default_model

def schema(max_length: int | None) -> dict:
    string = {"type": "string", **({"maxLength": max_length} if max_length else {})}
    return {"type": "object", "required": ["items"], "additionalProperties": False,
            "properties": {"items": {"type": "array", "minItems": 100, "maxItems": 200, "items": string}}}


def decode_steps(engine: LLMEngine, batch: int, steps: int, structured: StructuredOutput | None) -> list[float]:
    params = SamplingParams(max_tokens=steps + 20, temperature=1.0, seed=0, ignore_eos=structured is None,
                            structured_output=structured)
    messages = [{"role": "user", "content": f"List {i} things you like."} for i in range(batch)]
    for i, message in enumerate(messages):
        engine.add_request(f"r{i}-{structured is not None}", engine.encode_prompt(None, [message]), params)
    times = []
    while engine.has_unfinished_requests() and len(times) < steps + 5:
        start = time.perf_counter()
        engine.step()
        if len(engine.scheduler.running) == batch:  # a full batch of decodes (after the prefills)
            times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"r{i}-{structured is not None}")
    assert len(times) >= steps, f"only {len(times)} steps had the whole batch running"
    return times[5:]


def grammar_parts(engine: LLMEngine, batch: int, structured: StructuredOutput, repeats: int = 50) -> tuple[float, float]:
    import xgrammar

    matchers = [engine.grammars.matcher(structured) for _ in range(batch)]
    for matcher in matchers:  # into the array, where a step of the run spends its time
        for token in engine.tokenizer.encode('{"items": ["a', add_special_tokens=False):
            matcher.accept_token(token)
    fill = []
    for _ in range(repeats):
        start = time.perf_counter()
        bitmask = engine.grammars.bitmasks(matchers)
        fill.append(time.perf_counter() - start)
    logits = torch.randn(batch, engine.model_config.vocab_size)
    apply = []
    for _ in range(repeats):
        start = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(batch)))
        apply.append(time.perf_counter() - start)
    return statistics.median(fill), statistics.median(apply)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/structured_output_cost.json")
    args = parser.parse_args()
    engine = build_engine(EngineConfig(model=str(fetch_default_model()), max_num_seqs=args.batch))
    decode_steps(engine, args.batch, 5, None)  # warm-up
    rows = [{"case": "no grammar", "step_ms": statistics.median(decode_steps(engine, args.batch, args.steps, None)) * 1e3}]
    for label, max_length in (("strings free", None), ("strings maxLength 12", 12)):
        structured = StructuredOutput("json_schema", json.dumps(schema(max_length)))
        engine.grammars.compile(structured)  # compiled once, before the timing
        step = statistics.median(decode_steps(engine, args.batch, args.steps, structured))
        fill, apply = grammar_parts(engine, args.batch, structured)
        rows += [{"case": f"JSON schema, {label}: decode step", "step_ms": step * 1e3},
                 {"case": f"JSON schema, {label}: bitmask fill", "step_ms": fill * 1e3},
                 {"case": f"JSON schema, {label}: bitmask apply", "step_ms": apply * 1e3}]
    save_rows(args.out, rows, options=vars(args))
    print(markdown_rows([f"batch {args.batch}", "median (ms)", "vs a step without grammar"],
                        [[r["case"], f"{r['step_ms']:.2f}", f"{r['step_ms'] / rows[0]['step_ms']:.3f}x"] for r in rows]))


if __name__ == "__main__":
    main()

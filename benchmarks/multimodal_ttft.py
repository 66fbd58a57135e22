"""TTFT of an image request: Pagoda served with the encoder colocated and as its own deployment,
cold and with the embedding cache (and the prefix cache) hit, against HF transformers' `generate`
on the same checkpoint and inputs, in one session.

    python -m benchmarks.multimodal_ttft [--requests 5] [--out benchmarks/results/multimodal_ttft.json]

The checkpoint is LLaVA-1.5-shaped (tests/multimodal/models.py): CLIP ViT-B/16 at 224 px (196
image tokens, random weights: the timing does not depend on them), the two-layer projector,
SmolLM2-135M-Instruct as the language model. Each request is one user message: an image
(224x224 PNG) and a question, greedy, 1 token.

  cold            a new image: decode + processor, encode, prefill of the whole prompt
  encoder hit     an image already encoded, behind different text: the embeddings come from the
                  encoder cache, the prefill runs (the prefix differs before the image)
  both hits       the same request again: encoder cache, and the prompt's full blocks from the
                  prefix cache
  HF generate     processor + `generate(max_new_tokens=1)` in one process (no server), cold
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from cluster.bench.report import markdown_rows, save_rows
from cluster.ports import free_port
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc
from tests.multimodal.models import VIT_B16, build_llava, png

QUESTION = "Describe this picture in one sentence."


def conversation(seed: int, lead: str | None = None) -> list[dict]:
    content = [{"type": "text", "text": lead}] if lead else []
    content += [{"type": "image", "data": png(seed, (224, 224))}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


def hf_ttfts(model_dir: str, seeds: list[int]) -> list[float]:
    from transformers import LlavaForConditionalGeneration

    from tests.multimodal.conftest import HFMultimodalOracle

    oracle = HFMultimodalOracle(LlavaForConditionalGeneration, model_dir)
    oracle.greedy(conversation(999), 1)  # warm-up
    times = []
    for seed in seeds:
        start = time.perf_counter()
        oracle.greedy(conversation(seed), 1)
        times.append(time.perf_counter() - start)
    return times


def served_ttft(stub, metadata, messages: list[dict]) -> float:
    from cluster.serve.grpc_convert import grpc_messages

    request = pb.GenerateRequest(messages=grpc_messages(messages), sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    for _ in stub.Generate(request, metadata=metadata, timeout=600):
        return time.perf_counter() - start
    raise RuntimeError("no token came back")


def served_cases(stub, metadata, seeds: list[int]) -> dict[str, list[float]]:
    served_ttft(stub, metadata, conversation(998))  # warm-up
    cases = {"cold": [], "encoder hit": [], "both hits": []}
    for seed in seeds:
        cases["cold"].append(served_ttft(stub, metadata, conversation(seed)))
    for seed in seeds:
        cases["encoder hit"].append(served_ttft(stub, metadata, conversation(seed, lead=f"Picture {seed}:")))
    for seed in seeds:
        cases["both hits"].append(served_ttft(stub, metadata, conversation(seed)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5, help="requests per case")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/multimodal_ttft.json"))
    args = parser.parse_args()
    from ray import serve

    from cluster.bench.backends import default_model
    from cluster.serve import launcher
    from cluster.serve.app import build_app

    model_dir = str(build_llava(Path(tempfile.mkdtemp(prefix="pagoda-llava-")), Path(default_model(None)), vision=VIT_B16))
    seeds = list(range(args.requests))
    results = {"HF generate": {"cold": hf_ttfts(model_dir, seeds)}}
    http_port, grpc_port = free_port(), free_port()
    common = {"model": model_dir, "engine": {"kv_cache_bytes": 256 << 20}, "torch_threads": 2}
    launcher.start({**common, "engine": {**common["engine"], "encoder": "colocated"}}, http_port, grpc_port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            metadata = (("application", launcher.APP_NAME),)
            results["Pagoda, encoder colocated"] = served_cases(stub, metadata, seeds)
            serve.delete(launcher.APP_NAME)
            args_deployment = {**common, "engine": {**common["engine"], "encoder": "deployment"},
                               "encoder_server": {"ray_actor_options": {"num_cpus": 0}}}
            serve.run(build_app(args_deployment), name="deployment", route_prefix="/", blocking=False)
            results["Pagoda, encoder deployment"] = served_cases(stub, (("application", "deployment"),), seeds)
    finally:
        launcher.stop()
    hf_cold = statistics.median(results["HF generate"]["cold"])
    rows = [{"system": system, "case": case, "ttft_median_s": statistics.median(times), "ttft_s": times,
             "vs_hf_cold": statistics.median(times) / hf_cold}
            for system, cases in results.items() for case, times in cases.items()]
    print(json.dumps(rows, indent=1))
    save_rows(args.out, rows, model="LLaVA-1.5 shape: CLIP ViT-B/16-224 + SmolLM2-135M", requests=args.requests)
    print(markdown_rows(["system", "case", "TTFT median (s)", "vs HF generate, cold"],
                        [[r["system"], r["case"], f"{r['ttft_median_s']:.3f}", f"{r['vs_hf_cold']:.2f}x"] for r in rows]))


if __name__ == "__main__":
    main()

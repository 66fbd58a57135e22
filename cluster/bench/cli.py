"""`pagoda bench`: run a workload against any OpenAI-compatible server, Pagoda over gRPC, or HF in
this process; compare results (tables, plots)."""

from __future__ import annotations

import functools
from pathlib import Path

import click


@click.group()
def bench() -> None:
    """Benchmark Pagoda or any OpenAI-compatible server; compare results."""


@bench.command("run")
@click.option("--target", default="http://127.0.0.1:8000", show_default=True,
              help="http://HOST:PORT (any OpenAI-compatible server), grpc://HOST:PORT (Pagoda), or hf[:MODEL_DIR] (HF in this process)")
@click.option("--label", default=None, help="Name of this target in tables and plots.")
@click.option("--workload", type=click.Choice(["random", "chat", "docqa", "file", "probe"]), default="random", show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens per prompt (random, docqa).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True, help="max_tokens per request.")
@click.option("--range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Lengths uniform in [len*(1-r), len*(1+r)].")
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True, help="User turns per chat conversation.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--concurrency", default=None, help="Requests in flight; a comma list sweeps (1,4,16,32,64).")
@click.option("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (default: all at once).")
@click.option("--burstiness", type=float, default=1.0, show_default=True, help="Gamma shape of arrival gaps; 1 is Poisson.")
@click.option("--ignore-eos/--stop-at-eos", default=True, show_default=True, help="Generate exactly --output-len tokens.")
@click.option("--max-batch", type=click.IntRange(min=1), default=None, help="hf target: batch size (default: the concurrency).")
@click.option("--slo", default=None, help="Goodput SLOs in ms, e.g. ttft=500,tpot=100.")
@click.option("--tokenizer", "tokenizer_dir", default=None, help="For building prompts (default: the default model's).")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Unmeasured requests first.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None, help="Write the result JSON here.")
@click.option("--plots-dir", type=click.Path(file_okay=False), default=None, help="Write PNG plots here.")
@click.option("--ramp", "ramp", default=None, metavar="LOW:HIGH:SECONDS",
              help="A load ramp: users rise from LOW to HIGH over SECONDS, then fall; records a timeline "
                   "(Pagoda targets: replicas, nodes, queue too).")
@click.option("--ramp-hold", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Seconds at HIGH.")
def bench_run(target, label, workload, num_prompts, input_len, output_len, range_ratio, turns, prompts_file, seed,
              concurrency, request_rate, burstiness, ignore_eos, max_batch, slo, tokenizer_dir, warmup, out_path, plots_dir,
              ramp, ramp_hold) -> None:
    """Send a workload to TARGET and report TTFT/TPOT/ITL/E2E, throughput, failures and goodput."""
    from cluster.bench import report
    from cluster.bench.bench import run_bench
    from cluster.bench.metrics import parse_slo
    from cluster.bench.workloads import WorkloadSpec

    levels = [None]  # no cap: arrivals follow --request-rate
    if concurrency:
        try:
            levels = [int(c) for c in concurrency.split(",")]
        except ValueError:
            levels = [0]
        if min(levels) < 1:
            raise click.BadParameter("a positive integer or a comma list of them", param_hint="--concurrency")
    try:
        slo_s = parse_slo(slo)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--slo") from None
    spec = WorkloadSpec(workload, num_prompts, input_len, output_len, range_ratio, turns, prompts_file, seed)
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    if ramp:
        from cluster.bench.bench import run_ramp_bench
        from cluster.bench.ramp import RampSpec

        try:
            ramp_spec = RampSpec.parse(ramp, hold_s=ramp_hold)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--ramp") from None
        status_url = f"{target.rstrip('/').removesuffix('/v1')}/v1/pagoda/status" if target.startswith("http") else None
        run = functools.partial(run_ramp_bench, target, spec, ramp_spec, label=label, status_url=status_url,
                                ignore_eos=ignore_eos, tokenizer_dir=tokenizer_dir, warmup=warmup, log=log)
        table, plot = report.ramp_table, report.plot_ramp
    else:
        run = functools.partial(run_bench, target, spec, label=label, concurrencies=levels, request_rate=request_rate,
                                burstiness=burstiness, ignore_eos=ignore_eos, max_batch=max_batch, slo=slo_s,
                                tokenizer_dir=tokenizer_dir, warmup=warmup, log=log)
        table, plot = report.table, report.plot
    try:
        result = run()
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(table(result))
    if out_path:
        report.save(result, out_path)
    if plots_dir:
        for path in plot([result], plots_dir, prefix=Path(out_path).stem if out_path else "bench"):
            click.echo(f"plot: {path}", err=True)


@bench.command("compare")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--plots-dir", type=click.Path(file_okay=False), default=None)
@click.option("--prefix", default="compare", show_default=True, help="File name prefix of the plots.")
@click.option("--markdown", "as_markdown", is_flag=True, help="Also print the targets side by side as a Markdown table.")
def bench_compare(results, plots_dir, prefix, as_markdown) -> None:
    """Ratios of the first result file against each other one, load by load."""
    from cluster.bench import report

    loaded = [report.load(path) for path in results]
    if as_markdown:
        click.echo(report.markdown(loaded) + "\n")
    for result in loaded:
        click.echo(report.table(result) + "\n")
    if len(loaded) > 1:
        click.echo(report.ratio_table(loaded[0], loaded[1:]))
    if plots_dir:
        for path in report.plot(loaded, plots_dir, prefix=prefix):
            click.echo(f"plot: {path}", err=True)

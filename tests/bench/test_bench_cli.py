"""`pagoda bench` rejects bad options with a clear message and no traceback."""

import json

import pytest
from click.testing import CliRunner

from cluster.cli import main


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "four"], "--concurrency"),
    (["--slo", "ttft"], "--slo"),
    (["--workload", "poem"], "--workload"),
    (["--target", "ftp://127.0.0.1:1"], "--target must be"),
    (["--workload", "file"], "--workload file needs --prompts-file"),
    (["--ramp", "16:1:60"], "--ramp"),
    (["--ramp", "1:16"], "--ramp: expected LOW:HIGH:SECONDS"),
])
def test_bad_options_are_clear_errors(args, message, model_dir):
    result = CliRunner().invoke(main, ["bench", "run", "--tokenizer", model_dir, *args])
    assert result.exit_code in (1, 2), result.output
    assert message in result.output and "Traceback" not in result.output


def test_compare_prints_ratios_load_by_load(tmp_path):
    def result_file(label, throughput, ttft, tpot):
        summary = {"completed": 4, "requests": 4, "request_throughput": 1.0, "output_throughput": throughput,
                   "failures": {}, "ttft_ms": {"median": ttft, "p95": ttft, "p99": ttft},
                   "tpot_ms": {"median": tpot, "p95": tpot, "p99": tpot}, "itl_ms": {"median": tpot},
                   "e2e_ms": {"median": 1.0}}
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps({"label": label, "target": label, "runs": [{"concurrency": 4, "summary": summary, "records": []}]}))
        return str(path)

    result = CliRunner().invoke(main, ["bench", "compare", result_file("pagoda", 300.0, 50.0, 20.0), result_file("peer", 100.0, 100.0, 30.0)])
    assert result.exit_code == 0, result.output
    row = [line.split() for line in result.output.splitlines() if line.strip().startswith("c=4")][-1]
    assert row == ["c=4", "3.00", "2.00", "1.50"]

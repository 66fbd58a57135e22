"""Shared fixtures. The real default model is fetched once (make test does it before pytest)."""

from __future__ import annotations

import os
import signal

# OpenMP threads that sleep at a barrier instead of spinning: on a host shared with other busy
# processes (CI), a spinning torch thread that loses its core stalls every parallel region of the
# step (3-24x slower steps measured beside one CPU-bound process; docs/benchmarks-log.md). Set before
# torch loads; the servers and Ray workers the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The Ray workers' log lines (every request's access log among them) stay in the session's log
# files (/tmp/ray/session_latest/logs) instead of being shipped to, and printed by, every pytest
# worker: CPU the tests share, and lines that interleave with pytest's own output.
os.environ.setdefault("RAY_LOG_TO_DRIVER", "0")
# Ray runs its workers (the replicas, the engines) at nice 15, below everything else on the host:
# beside a build at nice 0 they got almost no CPU (a load of 41 on 2 cores) and a drain's short
# streams missed their 15 s. The clusters the tests start run them at the tests' own priority, so
# that a verdict does not depend on what else the host runs.
os.environ.setdefault("RAY_worker_niceness", "0")

# Ctrl-C as a terminal gives it: a shell that starts the suite in the background (`make test &`, a
# CI runner's script) leaves SIGINT ignored, every process the tests start inherits that, and
# Ray's `serve run` (which, unlike `pagoda serve`, sets no handler of its own) then never hears the
# Ctrl-C its test sends. Handled here, SIGINT is back to its default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import torch  # noqa: E402

from cluster.serve.launcher import PROXY_READY_TIMEOUT_ENV, SERVE_ENV_DEFAULTS  # noqa: E402

# What `pagoda serve` sets for its clusters, for the ones Ray's own tools start here too (`serve
# run`, the simulated multi-node cluster): a busy CI host must not get Serve's proxy killed for
# starting slowly.
os.environ.setdefault(PROXY_READY_TIMEOUT_ENV, SERVE_ENV_DEFAULTS[PROXY_READY_TIMEOUT_ENV])


# A test that uses one of these loads the real default model (or a server of it): slow.
REAL_MODEL_FIXTURES = {"model_dir", "tokenizer", "hf_model", "llm", "server", "stub", "ingress"}
# ...and one that uses these is served, on a Ray cluster or by the Ingress in process: `make test`
# only (`make test-fast` is `-m "not ray"`; modules that start Ray or serve a model themselves say
# `pytestmark = pytest.mark.ray`).
SERVED_FIXTURES = {"serve_cluster", "server", "stub", "ingress"}
SESSION_CLUSTER_FIXTURES = {"serve_cluster", "server", "stub"}


def pytest_configure(config):
    if os.environ.get("PAGODA_TEST_FAST"):  # make test-fast: a test that starts Ray is marked wrong
        import ray

        def refuse(*args, **kwargs):
            raise RuntimeError("make test-fast starts no Ray cluster: mark this test (or its module) `ray`")

        ray.init = refuse


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups set here
def pytest_collection_modifyitems(config, items):
    groups: dict[str, tuple[str, float]] = {}  # each test's group and rough cost: order_longest_groups_first
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if REAL_MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)  # `pytest -m "not slow"`: the fast tests alone
        if SERVED_FIXTURES & fixtures:
            item.add_marker(pytest.mark.ray)
        # `make test` runs pytest workers (xdist, --dist loadgroup) that take whole groups: every
        # test on the session's Ray cluster (its server's, and those that deploy applications of
        # their own beside it) in one, so one cluster starts in the run (a second one, idle between
        # its tests, cost the other worker's tests CPU the whole run); the other tests go by
        # module, so a module's fixtures are built once.
        long_apart = any(m.name == "xdist_group" for m in item.own_markers)  # a test given a group of its own
        if item.get_closest_marker("xdist_group") is None:
            group = "session-cluster" if SESSION_CLUSTER_FIXTURES & fixtures else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))
        cost = 20 if "ray" in item.keywords or long_apart else 4 if "slow" in item.keywords else 0.1
        groups[item.nodeid] = (item.get_closest_marker("xdist_group").args[0], cost)
    order_longest_groups_first(items, groups)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def order_longest_groups_first(items: list, groups: dict[str, tuple[str, float]]) -> None:
    """The groups in order of their rough cost, longest first (the Makefile's
    `--no-loadscope-reorder` keeps it): a long group started last keeps one pytest worker busy
    while the other waits. xdist's own order (most tests first) ran the small-chunks parity test, a
    group of one, last: the other worker idle for its 39 s (make test-fast). Rough costs, from the
    suite's junit times: a served test or one given a group of its own (a long one, run apart)
    tens of seconds, one of the real model in process seconds, the rest milliseconds."""
    group_cost: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        group, cost = groups[item.nodeid]
        group_cost[group] = group_cost.get(group, 0) + cost
        first_seen.setdefault(group, index)
    items.sort(key=lambda item: (-group_cost[groups[item.nodeid][0]], first_seen[groups[item.nodeid][0]]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """`--dist loadgroup` whose workers collected no "@group" ids is not grouping (pytest 9.2 with
    xdist 3.8: pytest-dev/pytest-xdist#1386): each worker would start its own session server and
    build every module's fixtures again. Said loudly instead of running slow."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit(f"--dist loadgroup does not group on pytest {pytest.__version__} "
                    "(pytest-dev/pytest-xdist#1386): pip install 'pytest<9.2'", returncode=4)


@pytest.fixture(scope="session")
def model_dir():
    from cluster.model_fetch import fetch_default_model

    return str(fetch_default_model())


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def llm(model_dir):
    """One engine for the tests that do not need special settings."""
    from cluster import LLM

    return LLM(model_dir, num_blocks=1024)


PARITY_MAX_TOKENS = 24
# How often Ray's metrics agent takes each process's metrics in the tests' clusters (seconds)
METRICS_EXPORT_S = 1


@pytest.fixture(scope="session")
def encoded(llm):
    """The parity prompts (tests/parity_prompts.py), tokenized by the engine."""
    from tests.parity_prompts import parity_prompts

    return [llm.engine.encode_prompt(p.get("prompt"), p.get("messages")) for p in parity_prompts()]


@pytest.fixture(scope="session")
def references(request, model_dir, encoded):
    """HF transformers' greedy answers to the parity prompts: the oracle (kept on disk)."""
    from tests.hf_reference import cached_greedy

    return cached_greedy(model_dir, lambda: request.getfixturevalue("hf_model"), [list(ids) for ids in encoded],
                         PARITY_MAX_TOKENS)


@pytest.fixture(scope="session")
def serve_cluster():
    """The session's real local Ray cluster with Serve's HTTP and gRPC proxies, no application yet:
    what modules that deploy applications of their own need (`server` adds Pagoda's)."""
    from cluster.ports import free_port
    from cluster.serve import launcher

    # Free ports: nothing else on the host (another checkout's tests, a server) can be in the way.
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    # Ray exports metrics every 10 s by default: every METRICS_EXPORT_S lets metric tests settle
    # quickly (at 10 s the waits made the session's group, the run's longest, ~55 s longer).
    os.environ.setdefault("RAY_metrics_report_interval_ms", str(METRICS_EXPORT_S * 1000))
    # 4 logical CPUs on 2 cores: room for the TP worker groups the disaggregation tests add.
    launcher.start_ray(num_cpus=4, metrics_port=metrics_port)
    launcher.start_serve(http_port, grpc_port)
    yield {"metrics": f"http://127.0.0.1:{metrics_port}/metrics", "http": f"http://127.0.0.1:{http_port}",
           "grpc": f"127.0.0.1:{grpc_port}", "http_port": http_port, "grpc_port": grpc_port}
    launcher.stop()


@pytest.fixture(scope="session")
def server(serve_cluster, model_dir):
    """Pagoda on the session's cluster, for the session."""
    from cluster.serve import launcher

    args = {
        "model": model_dir,
        "engine": {"kv_cache_bytes": 256 << 20, "max_num_seqs": 16},
        "max_waiting_requests": 32,
        # Generous: a test's verdict must not depend on the host's speed (a slow, busy host must
        # not turn a correct request into a timeout); the cancellation tests show that cancels
        # free blocks long before this deadline.
        "request_timeout_s": 300,
        "torch_threads": 2,
        "llm_server": {"max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 1}},
    }
    info = launcher.start(args, serve_cluster["http_port"], serve_cluster["grpc_port"])
    return {key: serve_cluster[key] for key in ("metrics", "http", "grpc")} | {"model": info["id"]}


@pytest.fixture(scope="session")
def stub(server):
    """A gRPC stub of the session's server."""
    import grpc

    from protos import inference_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(server["grpc"])
    yield pb_grpc.InferenceStub(channel)
    channel.close()


@pytest.fixture(scope="session")
def ingress(model_dir):
    """An Ingress with its engine in this process (no Ray, no Serve): tests/in_process_ingress.py."""
    from tests.in_process_ingress import InProcessIngress

    client = InProcessIngress(model_dir)
    yield client
    client.close()

"""A model server (LLMServer replica) killed mid-stream: its stream ends at once with UNAVAILABLE,
never a hang or INTERNAL, and the replica Serve starts in its place answers the next requests.
The Ingress reads a generation's deltas over Serve's gRPC transport (by value), whose failures
reach it differently from a Ray actor call's: this is where that path meets a dead replica."""

from __future__ import annotations

import grpc
import pytest

from tests.served_apps import answer_once_replaced, deployed, grpc_request, killed_mid_stream, status

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

LONG_ANSWER = 400


def test_a_model_server_killed_mid_stream_fails_the_stream_unavailable_and_serve_replaces_it(server, model_dir):
    long_request = grpc_request({"prompt": "Write a long story about a lighthouse keeper."},
                                max_tokens=LONG_ANSWER, ignore_eos=True)
    with deployed({**server, "model_dir": model_dir}, "pagoda-lost", "/lost") as app:
        [model_server] = [g for g in status(app)["groups"] if g["deployment"] == "LLMServer"]
        failure = killed_mid_stream(app, long_request, model_server["replica_pid"], LONG_ANSWER)
        assert failure.code() == grpc.StatusCode.UNAVAILABLE, failure.details()

        tokens, _ = answer_once_replaced(app, grpc_request({"prompt": "The capital of France is"}, max_tokens=8))
        assert len(tokens) == 8
        [replacement] = [g for g in status(app)["groups"] if g["deployment"] == "LLMServer"]
        assert replacement["replica_pid"] != model_server["replica_pid"]

"""Ingress: the Serve deployment of the serving front. It only wires the parts together:

    gRPC (Serve's proxy calls the RPCs by name) ─ GrpcService (grpc_adapter.py) ─┐
    HTTP (the FastAPI app Serve asks it for)    ─ OpenAIService (openai_adapter.py) ─┴─> RequestPipeline
                                                                          (pipeline.py) ─> LLMServer

The model server is a deployment (a handle), or, with engine_in_ingress, an LLMServer this
replica builds in its own process (in_process.py); the TenantLedger likewise.
"""

from __future__ import annotations

from fastapi import FastAPI

from cluster.serve.drain import replica_name
from cluster.serve.grpc_adapter import GrpcService
from cluster.serve.in_process import InProcess, LocalHandle
from cluster.serve.openai_adapter import OpenAIService, build_fastapi_app
from cluster.serve.pipeline import RequestPipeline
from cluster.serve.tenants import TenantsFile


class Ingress(GrpcService):
    def __init__(self, llm_server, ledger, model_name: str | None = None, limits: dict | None = None,
                 max_pending_requests: int = 256, front_door_dir: str | None = None, encoder_server=None,
                 tenants: TenantsFile | None = None, circuit_breaker: dict | None = None,
                 cors_allowed_origins: list[str] | None = None):
        # The LLMServer in this process (engine_in_ingress), or None
        self._server = llm_server.build() if isinstance(llm_server, InProcess) else None
        if self._server is not None:
            llm_server = LocalHandle(self._server)
            # Serve looks these up on the replica's object: this replica's health is its engine's,
            # and it scales on its engine's signals (the Ingress deployment takes llm_server's
            # autoscaling_config).
            self.check_health = self._server.check_health
            self.record_autoscaling_stats = self._server.record_autoscaling_stats
        if isinstance(ledger, InProcess):  # the one Ingress replica keeps the tenants' ledger
            ledger = LocalHandle(ledger.build())
        self.pipeline = RequestPipeline(
            llm_server, ledger, replica_name(self), model_name=model_name, limits=limits,
            max_pending_requests=max_pending_requests, front_door_dir=front_door_dir, encoder_server=encoder_server,
            tenants=tenants, circuit_breaker=circuit_breaker)
        self.cors_allowed_origins = list(cors_allowed_origins or [])  # browsers' origins allowed to call

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this in the replica once the Ingress exists (serve.ingress() without an app)."""
        return build_fastapi_app(OpenAIService(self.pipeline), self.cors_allowed_origins)

    def describe(self) -> dict | None:
        """Its engine's `describe()` where this replica holds one (`pagoda status`'s groups)."""
        return self._server.describe() if self._server is not None else None

    def __del__(self):  # Serve calls this on the replica's event loop when the replica stops
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.stop()
        if getattr(self, "_server", None) is not None:
            self._server.shutdown()

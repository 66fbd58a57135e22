"""CORS on the HTTP app: off unless origins are configured, then for those origins only (the app
alone, around a stand-in for the OpenAI service that answers /health)."""

import pytest
from fastapi.testclient import TestClient

from cluster.serve.openai_adapter import build_fastapi_app


class HealthyService:
    pipeline = None  # /health asks none

    async def health(self):
        return {"status": "ok", "model": "m"}


def preflight(client: TestClient, origin: str):
    return client.options("/health", headers={"Origin": origin, "Access-Control-Request-Method": "GET"})


def test_no_cors_unless_configured():
    client = TestClient(build_fastapi_app(HealthyService(), []))
    answer = client.get("/health", headers={"Origin": "https://evil.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    assert "access-control-allow-origin" not in preflight(client, "https://evil.example").headers


@pytest.mark.parametrize("origin, allowed", [("https://app.example", True), ("https://evil.example", False)])
def test_configured_origins_only(origin, allowed):
    client = TestClient(build_fastapi_app(HealthyService(), ["https://app.example"]))
    answer = preflight(client, origin)
    assert (answer.headers.get("access-control-allow-origin") == origin) is allowed
    assert (client.get("/health", headers={"Origin": origin}).headers.get("access-control-allow-origin") == origin) is allowed

"""Tenants and their API keys: who is asking, decided on the server from the key presented.

    tenants.yaml:
      compute_units: {prompt_token: 1, output_token: 4, media_item: 500}   # what a request costs
      tenants:
        team-a: {keys: ["sk-a-...", "sha256:9f86d0..."], weight: 2}
        team-b:
          keys: ["sha256:..."]
          max_concurrent_requests: 8
          max_units_per_request: 20000           # generation stops there (finish_reason "length")
          budget: {units: 1000000, window_s: 3600}   # over a rolling hour
        ops: {keys: ["sha256:..."], admin: true}    # may read /v1/pagoda/status (pids, addresses)

`pagoda serve --api-keys FILE` (or `api_keys_file:` in the Serve config) reads it once, when the
app is built, and hands the ingress only SHA-256 digests (plain keys never reach Serve's config or
the dashboard). A key may be written hashed, `sha256:HEX` of its UTF-8 bytes, so the file need not
hold secrets either. Without a file the server is open, and says so when it starts.

A presented key is hashed and compared with every stored digest by `hmac.compare_digest`, all of
them whatever matches: the time it takes says nothing about which key, or which prefix, is right.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SHA256_PREFIX = "sha256:"


class UnauthenticatedError(PermissionError):
    """No key, or a key of no tenant (401 / UNAUTHENTICATED)."""


class ForbiddenError(PermissionError):
    """A tenant's key where an admin's is needed (403 / PERMISSION_DENIED)."""


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    units: float = Field(gt=0)
    window_s: float = Field(gt=0, description="the rolling window the units are counted over")


class ComputeUnitPrices(BaseModel):
    """What a request costs, deterministically: tokens and media items, each at its price."""

    model_config = ConfigDict(extra="forbid")

    prompt_token: float = Field(1.0, ge=0)
    output_token: float = Field(1.0, ge=0)
    media_item: float = Field(0.0, ge=0, description="per image or audio clip")

    def units(self, prompt_tokens: int, output_tokens: int, media_items: int) -> float:
        return prompt_tokens * self.prompt_token + output_tokens * self.output_token + media_items * self.media_item


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(min_length=1, description='API keys: plain, or "sha256:HEX" of the key')
    weight: float = Field(1.0, gt=0, description="share of the engine under contention, against other tenants")
    admin: bool = Field(False, description="may read the cluster's internals (/v1/pagoda/status)")
    max_concurrent_requests: int | None = Field(None, ge=1, description="requests running at once, over all replicas")
    max_units_per_request: float | None = Field(None, gt=0, description="compute units one request may cost")
    budget: Budget | None = Field(None, description="compute units over a rolling window")

    @field_validator("keys")
    @classmethod
    def _keys_are_usable(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key.startswith(SHA256_PREFIX):
                digest = key.removeprefix(SHA256_PREFIX)
                if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                    raise ValueError(f"{key[:16]}...: a sha256: key needs 64 hex digits")
            elif len(key) < 16:
                raise ValueError("an API key needs at least 16 characters")
        return keys

    def digests(self) -> list[str]:
        return [key.removeprefix(SHA256_PREFIX).lower() if key.startswith(SHA256_PREFIX) else _sha256(key)
                for key in self.keys]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantConfig] = Field(min_length=1)
    compute_units: ComputeUnitPrices = Field(default_factory=ComputeUnitPrices)


def load_keys_file(path: str | Path) -> TenantsFile:
    """The keys file, every key turned into "sha256:HEX" of itself; ValueError naming the file
    and what is wrong."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        parsed = TenantsFile.model_validate(raw)
    except OSError as e:
        raise ValueError(f"API keys file {path}: {e.strerror}") from None
    except (yaml.YAMLError, ValidationError) as e:
        raise ValueError(f"API keys file {path}: {e}") from None
    owners: dict[str, str] = {}
    for name, tenant in parsed.tenants.items():
        for digest in tenant.digests():
            if owners.setdefault(digest, name) != name:
                raise ValueError(f"API keys file {path}: one key belongs to both {owners[digest]} and {name}")
    hashed = {name: tenant.model_copy(update={"keys": [SHA256_PREFIX + d for d in tenant.digests()]})
              for name, tenant in parsed.tenants.items()}
    return parsed.model_copy(update={"tenants": hashed})


class KeyRing:
    """Which tenant a presented key belongs to."""

    def __init__(self, tenants: dict[str, TenantConfig]):
        self._entries = [(bytes.fromhex(d), name) for name, t in tenants.items() for d in t.digests()]
        self._admins = {name for name, t in tenants.items() if t.admin}

    def tenant(self, presented: str | None) -> str:
        if not presented:
            raise UnauthenticatedError("an API key is required: send it as `Authorization: Bearer KEY`")
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for stored, tenant in self._entries:  # every entry, always: constant time
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise UnauthenticatedError("the API key is not valid")
        return found

    def admin(self, presented: str | None) -> str:
        """The tenant, which must be an admin."""
        tenant = self.tenant(presented)
        if tenant not in self._admins:
            raise ForbiddenError("this needs an admin's API key")
        return tenant


def bearer_key(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` value (HTTP header or gRPC metadata)."""
    if header is None:
        return None
    scheme, _, key = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise UnauthenticatedError("the Authorization header must be `Bearer KEY`")
    return key.strip()


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()

"""API keys and tenants, before any server: the keys file, and who a presented key belongs to."""

import hashlib

import pytest

from cluster.serve.tenants import ForbiddenError, KeyRing, UnauthenticatedError, bearer_key, load_keys_file

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"


def write(tmp_path, text: str):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def test_keys_plain_or_hashed_name_their_tenant(tmp_path):
    hashed_b = "sha256:" + hashlib.sha256(KEY_B.encode()).hexdigest().upper()
    ring = KeyRing(load_keys_file(write(tmp_path, f"tenants:\n  a: {{keys: [{KEY_A}], admin: true}}\n"
                                                  f"  b: {{keys: ['{hashed_b}'], weight: 2}}\n")).tenants)
    assert ring.tenant(KEY_A) == "a" and ring.tenant(KEY_B) == "b"
    assert ring.admin(KEY_A) == "a"
    with pytest.raises(ForbiddenError):
        ring.admin(KEY_B)
    for wrong in (KEY_A + "x", KEY_A[:-1], hashed_b, ""):
        with pytest.raises(UnauthenticatedError):
            ring.tenant(wrong)
    with pytest.raises(UnauthenticatedError, match="required"):
        ring.tenant(None)


def test_the_file_never_hands_plain_keys_on(tmp_path):
    tenants = load_keys_file(write(tmp_path, f"tenants:\n  a: {{keys: [{KEY_A}]}}\n"))
    assert tenants.tenants["a"].keys == ["sha256:" + hashlib.sha256(KEY_A.encode()).hexdigest()]
    assert KEY_A not in tenants.model_dump_json()


@pytest.mark.parametrize("text, reason", [
    ("tenants: {}\n", "tenants"),
    ("tenants:\n  a: {keys: [short]}\n", "at least 16 characters"),
    ("tenants:\n  a: {keys: ['sha256:abc']}\n", "64 hex digits"),
    (f"tenants:\n  a: {{keys: [{KEY_A}]}}\n  b: {{keys: [{KEY_A}]}}\n", "belongs to both a and b"),
    ("tenants:\n  a: {keys: [sk-0123456789abcdef], quota: 3}\n", "quota"),
    ("tenants: [oops\n", "keys.yaml"),
    ("tenants:\n  a: {keys: [sk-0123456789abcdef], budget: {units: 0, window_s: 60}}\n", "budget.units"),
    ("compute_units: {prompt_tokens: 1}\ntenants:\n  a: {keys: [sk-0123456789abcdef]}\n", "prompt_tokens"),
])
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path, text, reason):
    with pytest.raises(ValueError, match=reason):
        load_keys_file(write(tmp_path, text))


def test_a_missing_keys_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        load_keys_file(tmp_path / "nope.yaml")


def test_bearer_header():
    assert bearer_key("Bearer abc") == "abc" and bearer_key("bearer  abc ") == "abc" and bearer_key(None) is None
    for bad in ("Basic abc", "Bearer", "abc"):
        with pytest.raises(UnauthenticatedError, match="Bearer KEY"):
            bearer_key(bad)

"""`cache_salt` (vLLM's field) on both endpoints: the same salt shares its prefix, another gets nothing."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_cache_salt_over_http(server, path):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    if path == "/completions":
        body["prompt"] = list(range(200, 270))
    else:
        body["messages"] = [{"role": "user", "content": "salted " * 40}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = httpx.post(server.base_url + path, json={**body, **extra}, headers=server.headers(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    salt = f"tenant-{path}"
    cached(salt)
    assert cached(salt) > 0  # the same tenant gets its prefix back
    assert cached(salt + "-other") == 0  # another tenant gets nothing
    for bad in ("", 5, "x" * 300):
        r = httpx.post(server.base_url + path, json={**body, "cache_salt": bad}, headers=server.headers())
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text

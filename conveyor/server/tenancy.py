"""Who a request is served for (its tenant), from the HTTP request.

The tenant is the OpenAI `user` field by default (the field OpenAI defines to identify an end user);
`--tenant-key api-key` makes it the API key the client presented (several keys: `--api-key k1,k2`),
`--tenant-key header:NAME` the value of a header. A request that names none belongs to the default
tenant (`conveyor.request.tenant_name`). An API key is never used as a name as it is (names show up in
/metrics and logs): it becomes `key-` and the first 12 hex digits of its SHA-256. Nothing here knows any
scheduling strategy: the tenant is a plain field of the request record that strategies may read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from conveyor.server.http import bearer_token

MAX_TENANT_CHARS = 256


@dataclass(frozen=True)
class TenantRule:
    source: str = "user"  # user | api-key | header
    header: str | None = None  # for source == "header": the header's name (lower case)

    @classmethod
    def parse(cls, spec: str) -> TenantRule:
        """`user`, `api-key` or `header:NAME`; a ValueError otherwise."""
        spec = (spec or "user").strip()
        if spec in ("user", "api-key"):
            return cls(spec)
        if spec.startswith("header:") and spec[7:].strip():
            return cls("header", spec[7:].strip().lower())
        raise ValueError(f"--tenant-key must be user, api-key or header:NAME, got {spec!r}")

    def resolve(self, user: str | None, headers) -> str | None:
        """The tenant of a request with body field `user` and these HTTP `headers` (None: default tenant)."""
        if self.source == "user":
            name = user
        elif self.source == "header":
            name = headers.get(self.header)
        else:
            key = bearer_token(headers)
            name = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12] if key else None
        if not name:
            return None
        return name[:MAX_TENANT_CHARS]


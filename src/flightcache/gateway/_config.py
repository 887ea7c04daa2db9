"""The settings of one gateway, checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .._config import SCHEMES
from .._errors import ConfigError
from .._keys import check_namespace
from ._requestkey import Policy

__all__ = ["GatewayConfig"]


@dataclass(frozen=True)
class GatewayConfig:
    """Every setting of one gateway; ``make_app`` documents them."""

    upstream: str
    redis_url: str | None = None
    namespace: str = "gateway"
    policy: Policy = field(default_factory=Policy)
    lease: float = 3.0
    timeout: float = 600.0
    error_ttl: float = 2.0
    upstream_timeout: float = 300.0
    connect_timeout: float = 10.0
    max_connections: int = 256
    max_body_bytes: int = 32 * 1024 * 1024
    max_value_bytes: int = 64 * 1024 * 1024

    def check(self) -> None:
        try:
            parts = urlsplit(self.upstream)
            parts.port  # noqa: B018 (raises ValueError for a bad port)
        except ValueError:
            raise ConfigError("the upstream URL cannot be parsed") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("the upstream must be an http:// or https:// URL with a host")
        url = self.redis_url
        if url is not None and not url.startswith(tuple(SCHEMES)):
            raise ConfigError("the Redis URL must start with redis://, rediss:// or unix://")
        check_namespace(self.namespace)
        for name in ("lease", "timeout", "upstream_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be greater than 0")
        if not self.policy.ttl > 0 or not self.error_ttl >= 0:
            raise ConfigError("ttl must be greater than 0 and error_ttl at least 0")
        if self.max_connections < 1 or self.max_body_bytes < 1 or self.max_value_bytes < 2:
            raise ConfigError("max_connections, max_body_bytes and max_value_bytes too small")

"""`VastConfig`: what a Vast worker needs to know, read once from our settings and the platform's environment
(USE_SSL, VAST_TCP_PORT_<port>) so the rest of the package only sees one frozen value; None outside Vast."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

log = logging.getLogger("glmflash.vast")

VAST_ROUTES = ("/v1/chat/completions", "/v1/completions")


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class VastConfig:
    container_id: int | str
    report_addrs: tuple[str, ...]
    mtoken: str
    url: str  # http(s)://PUBLIC_IPADDR:VAST_TCP_PORT_<port>, where Vast's router sends requests
    unsecured: bool = False
    use_ssl: bool = False
    max_queue_time: float = 30.0  # HandlerConfig default; the in-flight wait (s) above which requests get 429
    allow_plain_requests: bool = False  # bodies without auth_data (they bypass the signature)
    default_max_tokens: int = 256  # chat requests without max_tokens, in workload_of
    routes: tuple[str, ...] = VAST_ROUTES

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None,
                      **overrides: Any) -> "VastConfig | None":
        """None outside Vast (no CONTAINER_ID / REPORT_ADDR); never raises on missing platform variables.

        Reads from `environ` (default os.environ): USE_SSL (default false, as metrics.get_url) and
        VAST_TCP_PORT_<settings.port> (the public port; the listen port itself when absent). Plain requests are
        allowed when UNSECURED or an API key guards them.
        """
        if not settings.vast_mode:
            return None
        env = os.environ if environ is None else environ
        use_ssl = _truthy(env.get("USE_SSL", "false"))
        public_port = env.get(f"VAST_TCP_PORT_{settings.port}")
        if not public_port:
            log.warning("event=vast_no_public_port var=VAST_TCP_PORT_%s using=%s", settings.port, settings.port)
            public_port = str(settings.port)
        public_ip = settings.public_ipaddr
        if not public_ip:
            log.warning("event=vast_no_public_ip var=PUBLIC_IPADDR using=127.0.0.1")
            public_ip = "127.0.0.1"
        cid: int | str = settings.container_id
        try:
            cid = int(cid)
        except ValueError:
            log.warning("event=vast_container_id_not_numeric value=%s", cid)
        values: dict[str, Any] = dict(
            container_id=cid,
            report_addrs=tuple(a.strip() for a in settings.vast_report_addr.split(",") if a.strip()),
            mtoken=settings.master_token or "",
            url=f"http{'s' if use_ssl else ''}://{public_ip}:{public_port}",
            unsecured=bool(settings.unsecured),
            use_ssl=use_ssl,
            allow_plain_requests=bool(settings.unsecured or settings.api_key),
        )
        for name in ("max_queue_time", "default_max_tokens"):
            value = getattr(settings, f"vast_{name}", None)
            if value is not None:
                values[name] = value
        values.update(overrides)
        return cls(**values)

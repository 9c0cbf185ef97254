"""The stand-in for Vast's side in tests: its autoscaler (`Controller`), the router's signatures and the vastai
package's own client pointed at it.

The controller records every /worker_status/ and /delete_requests/ body, serves the public key and answers /route/
with a reply signed by a test RSA key (signed with pycryptodome, the framework's own RSA library, independently of
the `cryptography` code under test).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from typing import Any, Callable

from aiohttp import web
from Crypto.Hash import SHA256
from Crypto.PublicKey import RSA
from Crypto.Signature import pkcs1_15
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from vastai.serverless.client.client import CoroutineServerless
from vastai.serverless.client.endpoint import Endpoint

from server_helpers import free_port

MTOKEN = "mtoken-0123456789abcdef"
CONTAINER_ID = 4242


def pem_public(key: rsa.RSAPrivateKey, fmt=serialization.PublicFormat.SubjectPublicKeyInfo) -> str:
    return key.public_key().public_bytes(serialization.Encoding.PEM, fmt).decode()


def sign_url(key: rsa.RSAPrivateKey, url: str) -> str:
    """What Vast's router puts in `signature`: the framework verifies exactly this (backend.py __check_signature)."""
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    message = json.dumps({"url": url}, indent=4, sort_keys=True)
    return base64.b64encode(pkcs1_15.new(RSA.import_key(der)).sign(SHA256.new(message.encode()))).decode()


class Controller:
    """Stand-in for run.vast.ai: /worker_status/, /delete_requests/, /pubkey/, /route/ (and console's sign_cert)."""

    def __init__(self, key: rsa.RSAPrivateKey, pubkey_pem: str | None = None) -> None:
        self.key = key
        self.pubkey_pem = pubkey_pem or pem_public(key)
        self.statuses: list[dict[str, Any]] = []
        self.status_times: list[float] = []
        self.deletes: list[dict[str, Any]] = []
        self.routes: list[dict[str, Any]] = []
        self.pubkey_gets = 0
        self.fail_status = 0  # answer 500 to this many /worker_status/ posts
        self.fail_pubkey = 0
        self.reqnum = 0
        self.cert_signer: Callable[[bytes, str], bytes] | None = None
        self.url = ""

    async def __aenter__(self) -> "Controller":
        app = web.Application()
        app.router.add_post("/worker_status/", self._status)
        app.router.add_post("/delete_requests/", self._delete)
        app.router.add_get("/pubkey/", self._pubkey)
        app.router.add_post("/route/", self._route)
        app.router.add_post("/api/v0/sign_cert/", self._sign_cert)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    async def _status(self, request: web.Request) -> web.Response:
        if self.fail_status > 0:
            self.fail_status -= 1
            return web.Response(status=500)
        self.statuses.append(await request.json())
        self.status_times.append(time.monotonic())
        return web.json_response({"ok": True})

    async def _delete(self, request: web.Request) -> web.Response:
        self.deletes.append(await request.json())
        return web.json_response({"ok": True})

    async def _pubkey(self, request: web.Request) -> web.Response:
        self.pubkey_gets += 1
        if self.fail_pubkey > 0:
            self.fail_pubkey -= 1
            return web.Response(status=503)
        return web.Response(text=self.pubkey_pem)

    async def _route(self, request: web.Request) -> web.Response:
        """The reply of POST /route/: the url the worker reported, signed (docs: {url, reqnum, signature, endpoint,
        cost, request_idx, __request_id}); no ready worker yet: {endpoint, status}."""
        body = await request.json()
        ready = [s for s in self.statuses if s["loadtime"] > 0 and not s["error_msg"]]
        if not ready:
            return web.json_response({"endpoint": body["endpoint"], "status": "loading"})
        self.reqnum += 1
        url = ready[-1]["url"]
        reply = {"url": url, "reqnum": self.reqnum, "signature": sign_url(self.key, url),
                 "endpoint": body["endpoint"], "cost": body["cost"],
                 "request_idx": body.get("request_idx") or 1000 + self.reqnum, "__request_id": f"r{self.reqnum}"}
        self.routes.append(reply)
        return web.json_response(reply)

    async def _sign_cert(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/octet-stream"
        return web.Response(body=self.cert_signer(await request.read(), request.query["instance_id"]))

    async def wait_status(self, predicate: Callable[[dict], bool], timeout: float = 5.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for status in self.statuses:
                if predicate(status):
                    return status
            await asyncio.sleep(0.005)
        raise AssertionError(f"no status matched; got {self.statuses}")

    async def wait_delete(self, request_idx: int, timeout: float = 5.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for body in self.deletes:
                for entry in body["requests"]:
                    if entry["request_idx"] == request_idx:
                        return entry
            await asyncio.sleep(0.005)
        raise AssertionError(f"request {request_idx} never deleted; got {self.deletes}")


def vast_client(ctl: Controller, ssl_context: ssl.SSLContext | None = None) -> tuple[CoroutineServerless, Endpoint]:
    client = CoroutineServerless(api_key="vast-account-key", autoscaler_url=ctl.url, max_poll_interval=0.2)
    client._ssl_context = ssl_context or ssl.create_default_context()  # instead of fetching Vast's root cert
    return client, Endpoint(client, name="glm-endpoint", id=7, api_key="endpoint-key")

"""What every request passes before a route sees it, and the line it leaves in the access log.

`Guard` is a plain ASGI middleware (it never buffers a streamed body):

- Host check: a web page on the same machine can make a browser send requests to 127.0.0.1 through a DNS name
  it controls (DNS rebinding); such a request carries that name in `Host`, so only the names this server is
  reached under are accepted (`HostRule`).
- API key: with one set, every path but `/health` and the dashboard's page and static files (`PAGE_PATHS`: they carry
  no data; the page asks for the key and sends it on its polls) needs `Authorization: Bearer KEY`, or `x-api-key:
  KEY` as Anthropic's clients send it (compared in constant time).
- Access log: one line per request on the `strata.access` logger: client, method, path, status, the prompt and
  generated tokens when the route counted them (`record_usage`), and the seconds until the last byte was sent.
- Memory: after a request that `release_memory_soon` marked (a large body), the heap is trimmed.

Refusals are OpenAI-shaped errors (Anthropic-shaped on the Messages API's paths), counted in `/metrics` like any
other.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from strata.server.api_errors import APIError
from strata.server.dashboard import PAGE_PATHS
from strata.server.memory import release_memory_async, wants_release
from strata.server.messages_protocol import error_body, is_messages_path

access_log = logging.getLogger("strata.access")

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)  # answered without the API key: load balancers and probes carry none
_USAGE_KEY = "strata.usage"


@dataclass(frozen=True)
class HostRule:
    """The `Host` headers a server accepts: `names` (lower case; IPv6 without brackets) on `port`, or any
    port for names listed in `any_port`; `names is None` accepts every host."""

    names: frozenset[str] | None
    port: int = 0
    any_port: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, host: str, port: int, allowed: str | None = None) -> HostRule:
        """The rule for a server bound to host:port: a wildcard bind accepts any host, a loopback bind the
        loopback names, any other address that address; `allowed` ("*" or "name[:port],...") replaces these."""
        if allowed is not None:
            entries = [e.strip().lower() for e in allowed.split(",") if e.strip()]
            if "*" in entries:
                return cls(None)
            exact, anywhere = set(), set()
            for entry in entries:
                name, entry_port = split_host(entry)
                if entry_port is None:
                    anywhere.add(name)
                else:
                    exact.add((name, entry_port))
            # names with a port are kept in `names` only when it is this server's port (others never match)
            names = {n for n, p in exact if p == port} | anywhere
            return cls(frozenset(names), port, frozenset(anywhere))
        host = host.strip("[]").lower()
        if host in WILDCARD_HOSTS:
            return cls(None)
        if host == "localhost" or _is_loopback(host):
            return cls(frozenset(LOOPBACK_NAMES), port)
        return cls(frozenset({host}), port)

    def accepts(self, header: str | None) -> bool:
        """Whether a request with this `Host` header value is for this server."""
        if self.names is None:
            return True
        if not header:
            return False
        name, port = split_host(header.lower())
        if name not in self.names:
            return False
        return name in self.any_port or port == self.port or (port is None and self.port == 80)

    def describe(self) -> str:
        """The accepted hosts, for an error message."""
        if self.names is None:
            return "any host"
        return ", ".join(sorted(n if n in self.any_port else f"{f'[{n}]' if ':' in n else n}:{self.port}"
                                for n in self.names))


def split_host(value: str) -> tuple[str, int | None]:
    """("name", port or None) of a Host header or `name[:port]` entry; IPv6 literals come without brackets."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end] if end > 0 else value[1:], value[end + 1:] if end > 0 else ""
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, ""  # a bare name, or an unbracketed IPv6 address
    return name, int(port) if port.isdigit() else None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def record_usage(scope: dict, usage: Callable[[], dict]) -> None:
    """Let the access log read a request's token counts (`usage()` -> {"prompt_tokens", "completion_tokens"})
    when its response has been sent, streamed or not."""
    scope[_USAGE_KEY] = usage


class Guard:
    """Host check, API key and access log around an ASGI app (see the module docstring)."""

    def __init__(self, app: Any, hosts: HostRule | None = None, api_key: str | None = None,
                 on_error: Callable[[APIError], None] | None = None):
        self.app, self.hosts, self.on_error = app, hosts, on_error
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [0]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                if self.on_error is not None:
                    self.on_error(refusal)
                body = error_body(refusal) if is_messages_path(scope.get("path")) else refusal.body()
                await JSONResponse(body, refusal.status, headers=refusal.headers)(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(_access_line(scope, status[0], time.perf_counter() - start))
        if wants_release(scope):  # a large request, answered: hand back what parsing and tokenizing took
            await release_memory_async()

    def _refusal(self, scope: dict) -> APIError | None:
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if not self.hosts.accepts(host):
                return APIError(400, f"the Host header {host!r} is not a name of this server (it answers to "
                                     f"{self.hosts.describe()}); to reach it under another name, start it with "
                                     "--allowed-hosts NAME", code="invalid_host")
        path = scope.get("path")
        if self.api_key is not None and path not in OPEN_PATHS and path not in PAGE_PATHS:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":
                given = b""
            given = given.strip() or headers.get(b"x-api-key", b"").strip()
            if not hmac.compare_digest(given, self.api_key):
                what = "an incorrect API key" if given else "no API key"
                return APIError(401, f"{what} was provided; send the server's key as 'Authorization: Bearer KEY' "
                                     "or 'x-api-key: KEY'", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        return None


def _access_line(scope: dict, status: int, seconds: float) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{who} "{scope.get("method", "-")} {scope.get("path", "-")}" {status or "-"}'
    usage = scope.get(_USAGE_KEY)
    if usage is not None:
        try:
            counts = usage()
            line += f" prompt_tokens={counts['prompt_tokens']} completion_tokens={counts['completion_tokens']}"
        except Exception:  # a log line never fails a request
            pass
    return f"{line} {seconds:.3f}s"

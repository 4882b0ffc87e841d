"""`strata serve`: plan, bind, then load the model behind an OpenAI-compatible endpoint.

    strata serve [MODEL] [--config config.toml] [--host 127.0.0.1] [--port 8090] [--dry-run]
                 [--max-batch 8] [--token-budget 2048] [--max-queue 64] [--decode-gap-target SECONDS] [--no-warmup]
                 [--api-key KEY | --api-key-file PATH] [--insecure-no-key] [--allowed-hosts NAMES]
                 [--max-tokens-default N] [--tool-call-parser FORMAT] [--no-access-log]

The API key comes from --api-key, --api-key-file or the STRATA_API_KEY environment variable; a server bound to
an address other than loopback without one is refused (exit 2) unless --insecure-no-key says so.

Order matters: the planner runs first and refuses a layout that cannot fit (exit 2, one line) before
the port is bound; then the port is bound (in use: exit 2, one line); then the server starts answering
(`/health` is 503) while the model loads in the background, and turns ready. SIGINT / SIGTERM stop
accepting, let in-flight requests finish for `--shutdown-timeout` seconds, cancel the rest, stop the
scheduler and close the tier manager; the command then returns 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from strata.config import StrataConfig, load_config
from strata.errors import ConfigError, StrataError
from strata.runtime.plan.checkpoints.store_cache import model_path
from strata.runtime.plan.numa import Binding
from strata.runtime.plan.planner import Plan
from strata.server.tools.calls import TOOL_FORMATS

log = logging.getLogger("strata.server")
API_KEY_ENV = "STRATA_API_KEY"
TOOL_FORMAT_NAMES = tuple(TOOL_FORMATS)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `strata serve`."""
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint or store directory, or a .gguf file (default: the demo model)")
    p.add_argument("--config", default=None, help="config.toml with overrides")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port to listen on (default 8090)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan, the binding and the effective configuration; load and bind nothing")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8); also sizes the planned KV cache (planner.max_batch)")
    p.add_argument("--token-budget", type=int, default=2048,
                   help="tokens per forward pass, decode + prefill (2048; runtime.decode_gap_target shrinks prompt chunks while others decode)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    p.add_argument("--decode-gap-target", type=float, default=None, metavar="SECONDS",
                   help="while sequences decode, prompt chunks shrink so a step stays under this many seconds "
                        "(default: runtime.decode_gap_target, 0.5; 0 turns it off)")
    p.add_argument("--no-warmup", action="store_true",
                   help="turn ready without the warm-up (runtime.warmup = false): the first requests of each decode "
                        "batch size then wait for its graph capture, and on a fresh install its kernel builds")
    p.add_argument("--served-model-name", default=None, help="the `model` clients must send (default: dir name)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (overrides runtime.device)")
    p.add_argument("--gpus", default=None, help="split the model over these GPUs, e.g. 0,1 (overrides runtime.devices)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are cancelled")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log level (default warning; the access log is separate: --no-access-log)")
    p.add_argument("--no-access-log", action="store_true",
                   help="do not log one line per request (method, path, status, tokens, seconds) on stderr")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every path but /health (visible "
                        f"to `ps`: prefer --api-key-file or {API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from the first line of PATH")
    p.add_argument("--insecure-no-key", action="store_true",
                   help="serve on an address other than loopback without an API key (refused otherwise)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="Host headers to answer, as name[:port],... or * for any (default: the bound address's "
                        "names, e.g. localhost/127.0.0.1/[::1] on a loopback bind; any on 0.0.0.0 or ::)")
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="cap what a chat request without max_tokens generates (default: the rest of the context, "
                        "as OpenAI)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_FORMAT_NAMES], metavar="FORMAT",
                   help="the format of the model's tool calls: auto (from its tokenizer and model type), "
                        f"{', '.join(TOOL_FORMAT_NAMES)}")


def cmd_serve(args: argparse.Namespace) -> int:
    """Run `strata serve`; user-caused failures raise StrataError (the CLI prints one line, exit 2)."""
    _check_args(args)
    cfg = load_config(args.config)
    if args.device != "auto":
        cfg.runtime.device = args.device
    if args.decode_gap_target is not None:
        cfg.runtime.decode_gap_target = args.decode_gap_target
    if getattr(args, "no_warmup", False):
        cfg.runtime.warmup = False
    if getattr(args, "gpus", None):  # one model split over several GPUs
        from strata.config_values import parse_gpus

        cfg.runtime.devices = parse_gpus(args.gpus)
    cfg.runtime.__post_init__()  # validates the overrides
    cfg.planner.max_batch = args.max_batch  # the KV cache is planned for the batch the scheduler runs
    path = _model_path(args.model)
    name = args.served_model_name or path.name
    the_plan = preflight_plan(path, cfg)  # PlanError propagates: refuse before binding the port
    print(the_plan.format() if the_plan is not None else "plan: runtime.experts = \"memory\": every expert is loaded "
          "into the compute device, no tiers")
    print(numa_binding(the_plan, dry_run=args.dry_run).describe())
    url = f"http://{_url_host(args.host)}:{args.port}/v1"
    if args.dry_run:
        print("effective configuration:")
        print(format_toml({**cfg.to_dict(), "serve": _serve_section(args, path, name)}))
        print(f"would serve {name!r} at {url} (dry run: no weights loaded, no port bound)")
        return 0
    sock = bind_socket(args.host, args.port)
    print(f"serving {name!r} at {url} (loading the model; GET /health turns 200 when ready)", flush=True)
    return _run(sock, path, cfg, name, args)


def numa_binding(the_plan: Plan | None, dry_run: bool) -> Binding:
    """Bind the CPU expert threads and pinned pools to the GPU's NUMA node (dry run: what would be bound)."""
    from strata.runtime.plan.numa import bind_to_node, gpu_numa_node

    device = the_plan.compute_device if the_plan is not None else "cpu"
    node = gpu_numa_node(int(device.split(":")[1])) if device.startswith("cuda:") else None
    if dry_run:
        return bind_to_node(node, set_mempolicy=lambda n: None, set_affinity=lambda c: None)
    return bind_to_node(node)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is out of range; use 0-65535")
    if args.max_batch < 1 or args.max_queue < 1:
        raise ConfigError("--max-batch and --max-queue must be >= 1")
    if args.token_budget < args.max_batch:
        raise ConfigError(f"--token-budget {args.token_budget} must be >= --max-batch {args.max_batch}")
    if args.shutdown_timeout < 0:
        raise ConfigError("--shutdown-timeout must be >= 0")
    if args.decode_gap_target is not None and not 0 <= args.decode_gap_target <= 3600:
        raise ConfigError(f"--decode-gap-target {args.decode_gap_target} is out of range; give seconds in [0, 3600]")
    if getattr(args, "max_tokens_default", None) is not None and args.max_tokens_default < 1:
        raise ConfigError(f"--max-tokens-default {args.max_tokens_default} must be >= 1")
    args.api_key = api_key(args)
    if args.api_key is None and not getattr(args, "insecure_no_key", False) and not is_loopback_host(args.host):
        raise ConfigError(f"--host {args.host} serves beyond this machine without an API key; give --api-key-file "
                          f"PATH (or set {API_KEY_ENV}), or pass --insecure-no-key to serve without one")


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address) reaches this machine alone: localhost, or only loopback addresses."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: every address it resolves to must be loopback
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def api_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """The key from --api-key or --api-key-file (not both), else the STRATA_API_KEY environment variable, or None."""
    key, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if key is not None and path is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if key is None and path is None:
        key = (os.environ if environ is None else environ).get(API_KEY_ENV) or None
        if key is not None:
            key = key.strip()
            if not key or not key.isascii() or any(c.isspace() for c in key):
                raise ConfigError(f"{API_KEY_ENV} must be printable ASCII without spaces; fix it or unset it")
    if path is not None:
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {path}: cannot be read ({e.strerror or e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {path}: its first line is empty; write the key there")
    if key is not None and (not key.strip() or not key.isascii() or any(c.isspace() for c in key)):
        raise ConfigError("the API key must be printable ASCII without spaces")
    return key


def _model_path(model: str | None) -> Path:
    if model is None:
        from strata.runtime.demo.model import ensure_default_model

        return ensure_default_model(progress=sys.stderr.isatty())
    return model_path(model)


def preflight_plan(path: Path, cfg: StrataConfig) -> Plan | None:
    """The plan `Engine.from_pretrained` will make, from headers alone (None for in-memory experts)."""
    if cfg.runtime.experts == "memory":
        return None
    from strata.runtime.plan.planner import plan_for

    return plan_for(path, cfg)  # the disk measured where the store is (or will be): an existing one needs no room


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a port in use (or a bad host) is a one-line StrataError."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} cannot be resolved ({e.strerror})") from None
    except OSError as e:
        hint = "; another server is running there, pick another --port" if e.errno == 98 else ""
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


def _run(sock: socket.socket, path: Path, cfg: StrataConfig, name: str, args: argparse.Namespace) -> int:
    import uvicorn

    from strata.server.app import create_app
    from strata.server.guard import HostRule, access_log

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the access log is ours (with token counts), at INFO whatever --log-level says, unless turned off
    access_log.setLevel(logging.CRITICAL + 1 if getattr(args, "no_access_log", False) else logging.INFO)
    hosts = HostRule.for_bind(args.host, sock.getsockname()[1], getattr(args, "allowed_hosts", None))
    app = create_app(None, None, name, hosts=hosts, api_key=getattr(args, "api_key", None),
                     max_tokens_default=getattr(args, "max_tokens_default", None),
                     tool_parser=getattr(args, "tool_call_parser", "auto"))
    server = _server_class()(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off"))
    loader = _Loader(app.state.strata, server, path, cfg, args)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.close()
        sock.close()
    if loader.is_alive():
        # stopped while the model loads. The loading thread cannot be interrupted, and the interpreter stopping it
        # at exit inside torch aborts the process ("terminate called without an active exception"): leave now. A
        # store being built is written under a temporary name, so nothing half-written stays.
        print("strata: shut down while loading the model", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    if loader.error is not None:
        raise loader.error
    print("strata: shut down cleanly", file=sys.stderr)
    return 0


class _Loader(threading.Thread):
    """Loads the engine and starts the scheduler while the server already answers (503 until ready)."""

    def __init__(self, state: Any, server: Any, path: Path, cfg: StrataConfig, args: argparse.Namespace):
        super().__init__(name="strata-loader", daemon=True)  # daemon: Ctrl+C during a long load still exits
        self.state, self.server, self.path, self.cfg, self.args = state, server, path, cfg, args
        self.engine: Any = None
        self.scheduler: Any = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self) -> None:
        from strata.engine import Engine
        from strata.runtime.generation.warmup import warm_up, warmup_on

        t0 = time.perf_counter()
        engine = sched = None
        try:
            engine = Engine.from_pretrained(self.path, config=self.cfg, progress=False)
            loaded = time.perf_counter() - t0
            sched = engine.scheduler(max_batch=self.args.max_batch, token_budget=self.args.token_budget,
                                     max_queue=self.args.max_queue)
            if warmup_on(self.cfg.runtime.warmup, engine.device):  # before ready: no user waits for a capture
                self.state.warming_up = True
                print(f"model loaded in {loaded:.1f} s; warming up (decode batch sizes 1-{self.args.max_batch}: "
                      "graph captures, and on a fresh install the GPU kernels' builds, ~25 s on an H200)", flush=True)
                print(warm_up(sched).describe(), flush=True)
            sched.start()
        except BaseException as e:  # noqa: B036 - reported by the main thread after the server stops
            self.error, self.state.load_error = e, f"loading the model failed: {e}"
            self.server.should_exit = True
            if sched is not None:  # e.g. a failed warm-up: its scheduler runs already
                sched.stop(drain=False)
            if engine is not None:
                engine.close()
            return
        with self._lock:
            self.engine, self.scheduler = engine, sched
            if self._closed:  # shut down while loading: nothing will serve this engine
                self._release()
                return
            self.state.attach(engine, sched)
        stats = engine.stats()
        print(f"ready in {time.perf_counter() - t0:.1f} s (model loaded in {loaded:.1f} s): {stats['device']} "
              f"({stats['dtype']}), max context {engine.max_context}, batch {self.args.max_batch}, prefill chunk "
              f"{engine.prefill_chunk}", flush=True)

    def close(self) -> None:
        """After the server stopped: cancel what is left, stop the scheduler, close the tier manager."""
        with self._lock:
            self._closed = True
            self._release()

    def _release(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop(drain=False)  # uvicorn already let requests finish; cancel stragglers
            self.scheduler = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, without re-raising the caught signal after a graceful shutdown (we return 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "localhost"
    return f"[{host}]" if ":" in host else host


def _serve_section(args: argparse.Namespace, path: Path, name: str) -> dict:
    return {"model": str(path), "served_model_name": name, "host": args.host, "port": args.port,
            "max_batch": args.max_batch, "token_budget": args.token_budget, "max_queue": args.max_queue,
            "shutdown_timeout": args.shutdown_timeout, "numa": "not bound",
            "allowed_hosts": args.allowed_hosts or "(the bound address's names)",
            "api_key": "set" if args.api_key else "none", "max_tokens_default": args.max_tokens_default or "none",
            "tool_call_parser": getattr(args, "tool_call_parser", "auto"),
            "access_log": not args.no_access_log}


def format_toml(d: dict, prefix: str = "") -> str:
    """Nested dicts of plain values as TOML (what `--config` accepts, plus the serve section for reference)."""
    lines = [f"\n[{prefix}]"] if prefix and any(not isinstance(v, dict) for v in d.values()) else []
    for k, v in d.items():
        if not isinstance(v, dict):
            plain = isinstance(v, str | int | float | bool | list)  # a list of these is a TOML array as JSON writes it
            lines.append(f"{k} = {json.dumps(v) if plain else json.dumps(str(v))}")
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(format_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(line for line in lines if line)

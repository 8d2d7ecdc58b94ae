"""``kvboost-rag serve --ray --replicas N``: the same server, N times, behind Ray Serve's HTTP proxy.

Each replica is a Ray actor that builds its own server from the command's arguments (model, engine,
scheduler: :func:`kvboost_rag.app.server.factory.build`), so only the arguments travel to the replicas, never a model.
Ray Serve balances requests across replicas; with a ``redis://`` store the replicas share document KV through
Redis and warmed documents through :mod:`kvboost_rag.app.server.catalogue`, so a document warmed through any
replica is a hit on every one. Each replica keeps its own in-memory tier and its own batch. Every response
names the replica that served it in the ``x-kvboost-replica`` header.

The ingress is a plain ASGI callable (accepted by ``serve.ingress`` in every Ray 2.x) that builds the FastAPI
app when Serve starts the replica (ASGI lifespan startup) and relays requests to it. Ray loads only here.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import signal
import socket
import sys
import time
from typing import Any

APP_NAME = "kvboost-rag"
REPLICA_HEADER = "x-kvboost-replica"
_ARG_TYPES = (str, int, float, bool, type(None))


def replica_params(args: argparse.Namespace) -> dict[str, Any]:
    """The ``serve`` arguments each replica rebuilds its server from: every plain value (model, batch,
    ``deterministic``, ...); the rest (none today) cannot travel to a Ray actor."""
    if not isinstance(args, argparse.Namespace):
        raise TypeError(f"args must be an argparse.Namespace, got {type(args).__name__}")
    return {k: v for k, v in vars(args).items() if isinstance(v, _ARG_TYPES)}


def _import_serve() -> Any:
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as exc:
        raise SystemExit(f"--ray needs Ray Serve: pip install 'kvboost-rag[ray]' ({exc})") from None
    return serve


def replica_name() -> str:
    """Serve's id of the replica running this code (host:pid outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:  # not inside a replica (tests, a plain process): something still unique
        return f"{socket.gethostname()}:{os.getpid()}"


class ReplicaApp:
    """The ASGI app Serve runs in every replica. Pickled with the arguments only; builds the server on first
    use (Serve's lifespan startup, when the replica starts) and then relays requests to it."""

    def __init__(self, args: dict[str, Any], keys: dict[str, str] | None) -> None:
        bad = sorted(k for k, v in args.items() if not isinstance(v, _ARG_TYPES))
        if bad:
            raise TypeError(f"args must hold plain values (str, int, float, bool, None); not {bad}")
        self.args = dict(args)
        self.keys = None if keys is None else dict(keys)
        self._app: Any = None
        self._name = ""
        self._lock: asyncio.Lock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"args": self.args, "keys": self.keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.args, self.keys = state["args"], state["keys"]
        self._app, self._name, self._lock = None, "", None

    def _build(self) -> None:
        from kvboost_rag.app.loading import set_threads
        from kvboost_rag.app.server.factory import build

        args = argparse.Namespace(**self.args)
        set_threads(args.threads, args.model)
        name = replica_name()
        self._app, _host = build(args, replica=name, keys=self.keys)
        self._name = name

    async def _ready(self) -> Any:
        if self._app is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._app is None:
                    await asyncio.to_thread(self._build)  # loading the model must not stall Serve's loop
        return self._app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        app = await self._ready()
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        header = (REPLICA_HEADER.encode(), self._name.encode("latin-1", "replace"))

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await app(scope, receive, tagged)


class KVBoostServer:
    """One replica of ``kvboost-rag serve`` (the routes are its ingress app's)."""


def connect(address: str | None = None, **local: Any) -> bool:
    """Join or start Ray; True when this process started a local cluster (and so must stop it).

    ``address``: None tries a running cluster (``ray start``) and falls back to a local one; "auto" requires
    a running cluster; "local" always starts one; anything else is an address for ``ray.init``. ``local``:
    ``ray.init`` options for a local cluster (num_cpus, object_store_memory, include_dashboard, ...)."""
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ValueError(f"address must be None or a non-empty str, got {address!r}")
    _import_serve()
    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        ray.init(**local)
        return True
    if address is not None:
        try:
            ray.init(address=address)
        except ConnectionError as exc:
            raise SystemExit(f"--ray-address {address}: {str(exc).splitlines()[0]}") from None
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        ray.init(**local)
        return True


def deploy(args: argparse.Namespace, keys: dict[str, str] | None, host: str) -> str:
    """Run ``--replicas`` replicas of the server on the connected cluster; returns the base URL once every
    replica has built its server."""
    serve = _import_serve()
    params = replica_params(args)
    replicas = args.replicas or 1
    options: dict[str, Any] = {"name": "KVBoostServer", "num_replicas": replicas}
    # Serve's own cap on requests in flight per replica (5 by default in recent Ray) would keep the batch
    # from filling and hide the server's 429: let through what the scheduler runs and queues.
    accepted = inspect.signature(serve.deployment).parameters
    cap = "max_ongoing_requests" if "max_ongoing_requests" in accepted else "max_concurrent_queries"
    options[cap] = args.max_batch + args.max_queue
    serve.start(http_options={"host": host, "port": args.port})
    ingress = serve.ingress(ReplicaApp(params, keys))(KVBoostServer)
    run_kw: dict[str, Any] = {}
    if "logging_config" in inspect.signature(serve.run).parameters:  # Serve's request lines, as --access-log
        run_kw["logging_config"] = {"enable_access_log": bool(args.access_log)}
    serve.run(serve.deployment(ingress, **options).bind(), name=APP_NAME, route_prefix="/", **run_kw)
    return f"http://{host}:{args.port}"


def stop(started_local: bool) -> None:
    """Shut Serve and the local cluster down; on a shared cluster remove only this application."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if started_local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """The ``--ray`` command: deploy, block until Ctrl-C (or SIGTERM), shut down."""
    from kvboost_rag.app.server.factory import access

    keys, host = access(args)
    _import_serve()
    started = connect(args.ray_address)
    try:
        url = deploy(args, keys, host)
        print(f"kvboost-rag serve: {args.served_model_name or args.model} on {url}/v1 through Ray Serve "
              f"({args.replicas or 1} replica(s), max batch {args.max_batch} each); Ctrl-C stops it",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("kvboost-rag serve: shutting down", file=sys.stderr, flush=True)
    finally:
        stop(started)
    return 0

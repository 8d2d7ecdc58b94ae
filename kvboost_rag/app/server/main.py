"""The ``kvboost-rag serve`` command: arguments and start-up. Heavy imports happen inside ``run``."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

from kvboost_rag.app.cli_util import positive_int

LOOPBACK = "127.0.0.1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="HF model path or id (default: the embedded demo model)")
    p.add_argument("--host", default=None, help=f"address to bind (default {LOOPBACK}; without --namespace-keys "
                                                "the server has no authentication, so keep it on loopback)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--store", default="memory", help="KV store spec: memory, disk:/path, redis://host:6379/0")
    p.add_argument("--namespace-keys", default=None, metavar="FILE",
                   help="JSON/YAML {api_key: namespace}: requires a key; each namespace has its own cache")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (1 turns batching off)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request before 504")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature when a request gives none (OpenAI's default is 1.0; 0 is greedy)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the embedded demo model, else torch's default)")
    p.add_argument("--access-log", action="store_true", help="log one line per request (never bodies)")
    ray = p.add_argument_group("scale-out on Ray Serve (pip install 'kvboost-rag[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: --replicas copies of this server behind Ray's HTTP proxy")
    ray.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="replicas, each loading the model (default 1; > 1 needs a redis:// --store, shared)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="'auto' (the running cluster `ray start` made), 'local' (start one here), or an "
                          "address; default: the running cluster if there is one, else a local one")
    p.add_argument("--debug-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: slow decode


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(args: argparse.Namespace) -> None:
    for name in ("max_batch", "port"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue < 0 or args.request_timeout <= 0 or not 0 <= args.default_temperature <= 2:
        raise SystemExit("--max-queue must be >= 0, --request-timeout > 0, --default-temperature in [0, 2]")
    if not getattr(args, "ray", False):
        for flag in ("replicas", "ray_address"):
            if getattr(args, flag, None) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')} needs --ray")
    elif (args.replicas or 1) > 1 and not str(args.store).startswith(("redis://", "rediss://")):
        raise SystemExit(f"--replicas {args.replicas} needs a shared --store redis://HOST:PORT/DB (got "
                         f"{args.store!r}): replicas on a per-process store would not share warmed documents")


def access(args: argparse.Namespace) -> tuple[dict[str, str] | None, str]:
    """Check the arguments, load the key file and say how the server is exposed: (keys, host to bind)."""
    from kvboost_rag.app.server.auth import load_key_file

    _check(args)
    try:
        keys = load_key_file(args.namespace_keys) if args.namespace_keys else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    host = args.host or LOOPBACK
    if keys is None:
        if args.host is None:
            print(f"kvboost-rag serve: no --namespace-keys, so no authentication: bound to {LOOPBACK} only",
                  file=sys.stderr)
        elif not _is_loopback(host):
            print(f"kvboost-rag serve: WARNING: serving on {host} without --namespace-keys: anyone who can "
                  "reach it can use the model and read its cache statistics", file=sys.stderr)
    return keys, host


def build(args: argparse.Namespace, *, replica: str | None = None,
          keys: dict[str, str] | None = None) -> tuple[Any, str]:
    """(the FastAPI app, the host to bind). ``replica`` names this process among several (Ray Serve), whose
    driver already ran :func:`access` and passes ``keys``: its responses name it, and documents warmed through
    any replica are registered by all (a redis:// store)."""
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.loading import load_engine
    from kvboost_rag.app.server.app import create_app
    from kvboost_rag.app.server.state import default_state

    if replica is None:
        keys, host = access(args)
    else:
        host = args.host or LOOPBACK
    loaded = load_engine(args.model, store=args.store)
    name = args.served_model_name or args.model
    aliases = (args.model, loaded.label, Path(args.model).name)
    state = default_state(KVBoostRAG(loaded.engine), name, keys=keys, max_batch=args.max_batch,
                          max_queue=args.max_queue, request_timeout=args.request_timeout,
                          step_delay=args.debug_step_delay, aliases=aliases)
    state.default_temperature = args.default_temperature
    if replica is not None:
        from kvboost_rag.app.server.catalogue import for_store

        state.replica = replica
        state.catalogue = for_store(args.store, loaded.engine.fingerprint)
    return create_app(state), host


def run(args: argparse.Namespace) -> int:
    if args.ray:
        from kvboost_rag.app.server.ray_serve import run as run_ray

        return run_ray(args)
    try:
        import uvicorn
    except ImportError as exc:
        raise SystemExit(f"the server needs its extra: pip install 'kvboost-rag[serve]' ({exc})") from None
    app, host = build(args)
    print(f"kvboost-rag serve: {app.state.kv.model_name} on http://{host}:{args.port}/v1 "
          f"(max batch {args.max_batch}, queue {args.max_queue})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=args.port, log_level="warning", access_log=args.access_log)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvboost-rag serve")
    add_arguments(p)
    args = p.parse_args(argv)
    from kvboost_rag.app.loading import set_threads

    set_threads(args.threads, args.model)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Building one server process from the ``serve`` arguments: checks, access rules, engine and FastAPI app.

Used by the plain command (:mod:`kvboost_rag.app.server.main`) and by each Ray Serve replica
(:mod:`kvboost_rag.app.server.ray_serve`), so both build the same server from the same arguments.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(args: argparse.Namespace) -> None:
    """The serve arguments alone, before anything loads: a bad one is one error line (exit status 2)."""
    for name in ("max_batch", "port"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "prefill_chunk", 0) < 0:
        raise SystemExit("--prefill-chunk must be >= 0 (0: whole prompts)")
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

    check_args(args)
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


def catalogue_bounds(args: argparse.Namespace) -> dict[str, int]:
    """The document catalogue's bounds given on the command line (the catalogue's defaults otherwise)."""
    bounds = {"max_entries": getattr(args, "catalogue_max_docs", None),
              "max_bytes": getattr(args, "catalogue_max_bytes", None)}
    return {k: v for k, v in bounds.items() if v is not None}


def build(args: argparse.Namespace, *, replica: str | None = None,
          keys: dict[str, str] | None = None) -> tuple[Any, str]:
    """(the FastAPI app, the host to bind). ``replica`` names this process among several (Ray Serve), whose
    driver already ran :func:`access` and passes ``keys``: its responses name it, and documents warmed through
    any replica are registered by all (a redis:// store)."""
    from kvboost_rag import KVBoostRAG, RAGOptions
    from kvboost_rag.app.loading import load_engine
    from kvboost_rag.app.server.app import create_app
    from kvboost_rag.app.server.state import default_state

    if replica is None:
        keys, host = access(args)
    else:
        host = args.host or LOOPBACK
    block = getattr(args, "block_adapter", None)
    loaded = load_engine(args.model, store=args.store, weights=getattr(args, "weights", "fp32"),
                         **({"block_adapter": block} if block else {}))
    name = args.served_model_name or args.model
    aliases = (args.model, loaded.label, Path(args.model).name)
    rag = KVBoostRAG(loaded.engine, RAGOptions(exact_turns=bool(getattr(args, "exact_turns", False))))
    state = default_state(rag, name, keys=keys, max_batch=args.max_batch,
                          max_queue=args.max_queue, request_timeout=args.request_timeout,
                          step_delay=args.debug_step_delay, aliases=aliases,
                          prefill_chunk=getattr(args, "prefill_chunk", 0) or None,
                          deterministic=getattr(args, "deterministic", True),
                          warm_budget=getattr(args, "warm_budget", 256),
                          kv_pool_bytes=getattr(args, "kv_pool", None), page_tokens=getattr(args, "page_tokens", 16),
                          max_documents=getattr(args, "max_documents", 256),
                          max_document_bytes=getattr(args, "max_document_bytes", 8 * 2**20))
    state.default_temperature = args.default_temperature
    if replica is not None:
        from kvboost_rag.app.server.catalogue import for_store

        state.replica = replica
        state.catalogue = for_store(args.store, loaded.engine.fingerprint, **catalogue_bounds(args))
    return create_app(state), host

"""The ``kvboost-rag serve`` command: arguments and start-up. Heavy imports happen inside ``run``."""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from kvboost_core.config import PRECISIONS
from kvboost_rag.app.cli_util import UserError, positive_int
from kvboost_rag.app.server.factory import LOOPBACK, build, check_args


def parse_size(value: str) -> int:
    """argparse type: a byte size (``64MiB``, ``1000000``) >= 1."""
    from kvboost_core.config import parse_bytes

    try:
        n = parse_bytes(value)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {value!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a short name, HF model directory or hub id (default smollm2-135m-instruct); 'demo' is the "
                        "embedded 2M-parameter model: fast (the tests use it), not a real answer")
    p.add_argument("--block-adapter", default=None, metavar="DIR|shipped",
                   help="serve with a block adapter (kvboost-rag adapt --block; 'shipped': the one trained for "
                        "--model): documents are served at repair='none' as that adapted model's own prefill")
    p.add_argument("--weights", choices=PRECISIONS, default="fp32",
                   help="precision the model's linear weights are held at (default fp32): fp16 packs them for "
                        "FBGEMM on the CPU, about 2x faster decode with fp32 activations (docs/limits.md)")
    p.add_argument("--host", default=None, help=f"address to bind (default {LOOPBACK}; without --namespace-keys "
                                                "the server has no authentication, so keep it on loopback)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--store", default="memory",
                   help="KV store spec: memory, disk:/path, redis://host:6379/0 (default memory)")
    p.add_argument("--namespace-keys", default=None, metavar="FILE",
                   help="JSON/YAML {api_key: namespace}: requires a key; each namespace has its own cache")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together (default 8; 1 turns batching off)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                   help="chunked prefill: a long prompt's head is computed about this many tokens per scheduler "
                        "iteration, between the running requests' decode steps (default 512; 0: whole prompts). "
                        "Outputs do not depend on it")
    p.add_argument("--warm-budget", type=positive_int, default=256, metavar="TOKENS",
                   help="POST /v1/documents is warmed between decode steps, about this many document tokens per "
                        "scheduler iteration (one layer at least; while requests decode, a slice also ends after "
                        "0.3 of a decode step's time) (default 256)")
    p.add_argument("--max-documents", type=positive_int, default=256, metavar="N",
                   help="documents one POST /v1/documents may send; more is answered 413 (default 256)")
    p.add_argument("--max-document-bytes", type=parse_size, default=8 * 2**20, metavar="SIZE",
                   help="bytes of document text one POST /v1/documents may send; more is answered 413 "
                        "(default 8MiB)")
    p.add_argument("--kv-pool", type=parse_size, default=None, metavar="SIZE",
                   help="hold the decoding requests' KV in pages of one pool of this size (e.g. 2GiB): pages with "
                        "the same contents (the same documents at the same positions, a system head) are held "
                        "once, and a request waits while the pool is full; Llama-shaped fp32 models only "
                        "(default off: a dense row per request)")
    p.add_argument("--page-tokens", type=positive_int, default=16, metavar="N",
                   help="tokens per page of --kv-pool (default 16)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="a request's output does not depend on the requests batched with it, to the last bit of "
                        "its logits (default on); --no-deterministic runs each decode step as plain batched "
                        "calls, faster at large batches (see docs/serving.md)")
    p.add_argument("--exact-turns", action="store_true",
                   help="compute every chat turn exactly (documents never re-placed): answers are the full "
                        "prefill's and a follow-up waits for no backfill, but a chat's first turn costs a full "
                        "prefill (default off: turn 1 re-places its documents, the backfill makes them exact)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds per request before 504 (default 300)")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature when a request gives none (default 1.0, OpenAI's: sampled; 0 is greedy). "
                        "--deterministic is about batching, not sampling: a request's own seed fixes its "
                        "sampling")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the embedded demo model, else torch's default)")
    p.add_argument("--catalogue-max-docs", type=positive_int, default=None, metavar="N",
                   help="with --ray and a redis:// --store: documents each namespace's shared catalogue announces "
                        "to the other replicas, oldest evicted first (default 10000)")
    p.add_argument("--catalogue-max-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="with --ray and a redis:// --store: bytes of document text per namespace in that "
                        "catalogue, oldest evicted first (default 64MiB; e.g. 256MiB)")
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


def bind(host: str, port: int) -> socket.socket:
    """The socket for ``host:port``, bound now and listening only once uvicorn serves on it (until then a
    client is refused, as before): a port in use is one error line before the model loads."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UserError(f"--host {host}: cannot bind it ({exc.strerror or exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        why = "in use by another process; choose another --port" if exc.errno == errno.EADDRINUSE \
            else (exc.strerror or str(exc))
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({why})") from None
    return sock


def preflight(args: argparse.Namespace) -> socket.socket | None:
    """What can be checked before anything heavy loads (torch, the weights): the arguments, ``--model``
    resolvable, and the port free (bound here: the socket is returned, None with --ray, whose proxy binds
    it). A problem is one ``kvboost-rag: error:`` line and exit status 2, in well under a second."""
    from kvboost_rag.app import demo_data as dd
    from kvboost_rag.app.loading import DEMO, check_model_arg

    check_args(args)
    if args.model == DEMO:
        if not dd.demo_model_available():
            raise UserError(f"--model {DEMO}: the embedded demo model is missing ({dd.DEMO_MODEL_DIR}); pass "
                            "--model PATH or build it with scripts/train_demo_model.py")
    else:
        check_model_arg(args.model)
    return None if args.ray else bind(args.host or LOOPBACK, args.port)


def _exit_zero(signum: int, frame: Any) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def sigterm_exits_zero() -> Iterator[None]:
    """SIGTERM before the server serves (checks, loading) stops the command with exit status 0, as it does
    while serving (:func:`run`); the handler is restored after. Signals belong to the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _exit_zero)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def run(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Serve until stopped; SIGTERM or Ctrl-C shuts down gracefully (SIGTERM: exit status 0). ``sock`` is
    :func:`preflight`'s; without it the checks run here."""
    if sock is None and not args.ray:
        sock = preflight(args)
    if args.ray:
        from kvboost_rag.app.server.ray_serve import run as run_ray

        return run_ray(args)
    assert sock is not None
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        try:
            import uvicorn
        except ImportError as exc:
            raise SystemExit(f"the server needs its extra: pip install 'kvboost-rag[serve]' ({exc})") from None
        app, host = build(args)
        print(f"kvboost-rag serve: {app.state.kv.model_name} on http://{host}:{args.port}/v1 "
              f"(max batch {args.max_batch}, queue {args.max_queue}"
              f"{'' if args.deterministic else ', not deterministic'})", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=args.access_log))
        if main_thread:
            # While serving, uvicorn handles SIGTERM itself (a graceful shutdown) and then raises it again once
            # stopped, which under the default handler made the exit status 143; under this one that second
            # SIGTERM is harmless (exit 0), and one arriving before uvicorn takes over stops it before it serves.
            signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
        server.run(sockets=[sock])
    finally:
        sock.close()
        if main_thread and before is not None:
            signal.signal(signal.SIGTERM, before)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvboost-rag serve")
    add_arguments(p)
    args = p.parse_args(argv)
    from kvboost_rag.app.cli_util import run_guarded
    from kvboost_rag.app.loading import set_threads

    def serve() -> int:
        with sigterm_exits_zero():
            sock = preflight(args)  # before torch is imported
            set_threads(args.threads, args.model)
            return run(args, sock)

    return run_guarded(serve, debug=False)


if __name__ == "__main__":
    sys.exit(main())

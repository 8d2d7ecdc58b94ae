"""Storage benchmark: bytes/token per kv_bits, cold disk load speed, a restart from disk against recomputation,
cross-process Redis hit rate.

    python benchmarks/bench_storage.py --json benchmarks/results/storage.json

KV shaped like Qwen2.5-0.5B (24 layers, 2 KV heads, head_dim 64), random values (byte counts do not depend
on them; load speed hardly does); the restart run uses the random-weight model of that shape. About four
minutes on 2 CPU cores, most of it the recomputation it is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvboost_core.keys import CacheKey, Fingerprint  # noqa: E402
from kvboost_core.kv_encode import maybe_quantize  # noqa: E402
from kvboost_core.quant import bytes_per_token  # noqa: E402
from kvboost_core.store import DensePayload, DiskStore, KVBlock, RedisStore  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 24, 2, 64
FP = Fingerprint("0" * 32)
CHUNK = 128
MODES: dict[str, tuple[torch.dtype, int | None]] = {
    "fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, 8),
    "int4": (torch.float32, 4)}


def dense(n: int, seed: int, dtype: torch.dtype = torch.float32) -> DensePayload:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, n, HEAD_DIM)  # (L, H, n, D)
    return DensePayload(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def payload(mode: str, n: int, seed: int, group_size: int = 32) -> Any:
    dtype, bits = MODES[mode]
    return maybe_quantize(dense(n, seed, dtype), bits, group_size)


def key(i: int) -> CacheKey:
    return CacheKey(i.to_bytes(16, "big"))


def block(mode: str, i: int, n: int = CHUNK) -> KVBlock:
    return KVBlock(tuple(range(i * n, (i + 1) * n)), payload(mode, n, i), base_position=i * n, fingerprint=FP,
                   namespace="bench")


def bench_bytes_per_token() -> dict[str, Any]:
    bf16 = bytes_per_token(payload("bf16", CHUNK, 0))
    out: dict[str, Any] = {}
    for mode in MODES:
        bpt = bytes_per_token(payload(mode, CHUNK, 0))
        out[mode] = {"bytes_per_token": bpt, "ratio_vs_bf16": round(bpt / bf16, 4)}
    for g in (64, 128):  # what a larger group would buy (default is 32)
        for mode in ("int8", "int4"):
            bpt = bytes_per_token(payload(mode, CHUNK, 0, g))
            out[f"{mode}_group{g}"] = {"bytes_per_token": bpt, "ratio_vs_bf16": round(bpt / bf16, 4)}
    return out


def _drop_page_cache(root: Path) -> None:
    # Best effort without root: ask the kernel to forget the (clean, fsynced) pages of our files.
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(tokens: int = 4096) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("bf16", "int8", "int4"):
        root = Path(tempfile.mkdtemp(prefix="kvboost-bench-"))
        try:
            store = DiskStore(root, 10**10, FP)
            nblocks = tokens // CHUNK
            for i in range(nblocks):
                store.put(key(i), block(mode, i))
            file_bytes = store.stats()["bytes"]
            _drop_page_cache(root)
            t0 = time.perf_counter()
            cold = DiskStore(root, 10**10, FP)  # fresh process view: index rebuilt, no memory tier
            t_index = time.perf_counter() - t0
            for i in range(nblocks):
                b = cold.get(key(i))
                assert b is not None
                b.payload.to_dense(torch.bfloat16, "cpu")
            secs = time.perf_counter() - t0
            out[mode] = {"tokens": tokens, "blocks": nblocks, "file_mb": round(file_bytes / 1e6, 2),
                         "load_s": round(secs, 4), "index_rebuild_s": round(t_index, 4),
                         "file_mb_per_s": round(file_bytes / 1e6 / secs, 1),
                         "dense_bf16_mb_per_s": round(tokens * LAYERS * HEADS * HEAD_DIM * 4 / 1e6 / secs, 1)}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def bench_cold_start(tokens: int, seed: int = 0) -> dict[str, Any]:
    """A restarted server's first request, KV from disk vs recomputation, on the random-weight Qwen2.5-0.5B
    shape in fp32: process A prefilled a ``tokens``-token prompt (its prefix chunks went to a disk store);
    a fresh engine on the same directory (index rebuilt by scanning, page cache dropped) then answers the
    same context with a new question. TTFT from the call's start: lookup, reads, checksums, dequantization,
    placement, and the fresh tail."""
    from kvboost_core import KVEngine, Segment
    from kvboost_rag.app.bench.ttft import build_model

    model, tok = build_model("qwen2.5-0.5b", None)
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(1000, 100_000, (tokens,), generator=g).tolist()

    def prompt(q: int) -> list[Segment]:
        return [Segment(token_ids=context), Segment(token_ids=[100 + q] * 16)]

    cold = KVEngine(model, tok, store="memory", store_prefix=False)  # nothing stored, nothing found
    cold.prefill(prompt(0))  # warm-up (lazy init) off the clock
    t0 = time.perf_counter()
    ref = cold.prefill(prompt(1))
    out: dict[str, Any] = {"tokens": tokens + 17, "recompute_s": round(time.perf_counter() - t0, 3)}
    for mode, bits in (("bf16", 16), ("int8", 8), ("int4", 4)):
        root = Path(tempfile.mkdtemp(prefix="kvboost-cold-"))
        try:
            KVEngine(model, tok, store=f"disk:{root}", kv_bits=bits).prefill(prompt(2))  # process A
            _drop_page_cache(root)
            t0 = time.perf_counter()
            fresh = KVEngine(model, tok, store=f"disk:{root}", kv_bits=bits)  # process B after a restart
            t_open = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = fresh.prefill(prompt(1), store_prefix=False)
            secs = time.perf_counter() - t0
            top1 = int(torch.argmax(res.last_logits)) == int(torch.argmax(ref.last_logits))
            out[mode] = {"ttft_s": round(secs, 3), "open_s": round(t_open, 4),
                         "speedup_vs_recompute": round(out["recompute_s"] / secs, 1),
                         "reused_exact": res.stats["reused_exact"], "top1_same_as_recompute": top1}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from benchmarks.bench_storage import block, key
    from kvboost_core.store import RedisStore
    s = RedisStore({url!r}, namespace="bench", fingerprint={fp!r})
    ok = sum(s.put(key(i), block({mode!r}, i)) for i in range({n}))
    print(ok)
""")


def bench_redis(n: int = 32, mode: str = "int8") -> dict[str, Any]:
    exe = shutil.which("redis-server")
    if exe is None:
        return {"skipped": "redis-server not installed"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                               "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        code = WRITER.format(repo=str(REPO), url=url, fp=FP, mode=mode, n=n)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        stored = int(res.stdout.strip() or 0)
        reader = RedisStore(url, namespace="bench", fingerprint=FP)  # process B
        t0 = time.perf_counter()
        hits = sum(reader.get(key(i)) is not None for i in range(n))
        secs = time.perf_counter() - t0
        return {"mode": mode, "blocks_put_by_process_a": stored, "blocks_requested_by_process_b": n,
                "hits": hits, "hit_rate": hits / n, "get_ms_per_block": round(1000 * secs / n, 2)}
    finally:
        server.terminate()
        server.wait(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "storage.json")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens in the cold disk load")
    ap.add_argument("--cold-start-tokens", type=int, default=4096,
                    help="context of the restart-from-disk vs recompute run on the 0.5B shape (0 skips)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = {"shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "chunk": CHUNK,
                         "group_size": 32},
               "bytes_per_token": bench_bytes_per_token(), "disk_cold_load": bench_disk(args.tokens),
               "redis_cross_process": bench_redis()}
    if args.cold_start_tokens:
        results["cold_start_vs_recompute"] = bench_cold_start(args.cold_start_tokens)
    results["runtime_s"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

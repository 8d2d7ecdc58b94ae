"""Serving benchmark: `kvboost-rag serve` under RAG chat load, driven by the official openai async client.

For each concurrency level, closed-loop clients send RAG chat requests (warmed documents in a new order plus a
question) and stream the answers: output tokens/s, TTFT and end-to-end p50/p99, errors. The same workload runs
against the server with batching (``--max-batch 8``), without (``--max-batch 1``), and as plain HF greedy
generation run sequentially in process (full prefill, no reuse). Outputs of the batched server are compared
with the unbatched server's (sequential greedy through the same reuse path): equal since decode is batch-invariant
and prefill history-independent (benchmarks/serve_determinism.py checks the logits bitwise). Also measured: decode throughput
from the server's own step timer, the batch's KV memory at the top concurrency, and the stall one long cold
prompt causes the requests decoding when it arrives.

    python benchmarks/bench_serve.py --json benchmarks/results/serve.json --plot benchmarks/results/serve.png
    python benchmarks/bench_serve.py --model demo --requests 64 --concurrency 1,4,8,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations"), str(ROOT / "tests")]
SMOLLM = Path("/root/.cache/kvboost-rag/models/smollm2-135m-instruct")


def workload(model_dir: Path | None, n_requests: int, doc_records: int, docs_per_prompt: int, seed: int = 0
             ) -> tuple[list[str], list[list[dict[str, str]]]]:
    """(documents to warm, chat requests): documents are runs of the demo corpus' fact records; each request
    puts ``docs_per_prompt`` of them, in a new order, before a question about one of them."""
    from kvboost_rag.app import demo_data as dd

    records = [d["text"] for d in dd.load_corpus()]
    docs = [" ".join(records[i:i + doc_records]) for i in range(0, len(records) - doc_records + 1, doc_records)]
    rng = random.Random(seed)
    requests = []
    for _ in range(n_requests):
        chosen = rng.sample(docs, min(docs_per_prompt, len(docs)))
        subject = rng.choice(chosen).split(" ", 1)[0]
        user = dd.build_prompt(chosen, f"What is the country of {subject}?")
        requests.append([{"role": "system", "content": "Answer with the fact from the documents."},
                         {"role": "user", "content": user}])
    return docs, requests


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def scrape(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for ln in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if ln and not ln.startswith("#") and "{" not in ln:
            k, v = ln.rsplit(" ", 1)
            out[k] = float(v)
    return out


async def one(client: Any, messages: list[dict[str, str]], max_tokens: int, t_list: list | None = None
              ) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    parts, usage = [], None
    try:
        stream = await client.chat.completions.create(
            model="bench", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if ttft is None:
                    ttft = now - t0
                if chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    if t_list is not None:
                        t_list.append(now)
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # counted, never fatal: the figure is the error count
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    e2e = time.perf_counter() - t0
    return {"text": "".join(parts), "ttft": ttft or e2e, "e2e": e2e, "tokens": usage.completion_tokens if usage else 0,
            "cached": usage.prompt_tokens_details.cached_tokens if usage else 0,  # exact reuse only
            "approx": (usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_approximate", 0) if usage else 0,
            "prompt": usage.prompt_tokens if usage else 0}


async def level(url: str, requests: list, concurrency: int, max_tokens: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    queue = list(enumerate(requests))
    results: list[dict[str, Any] | None] = [None] * len(requests)

    async def worker() -> None:
        while queue:
            i, msgs = queue.pop(0)
            results[i] = await one(client, msgs, max_tokens)

    peak = {"batch_kv_bytes": 0.0}

    async def sample() -> None:  # the batch's KV buffers while the level runs
        import httpx

        async with httpx.AsyncClient() as http:
            while True:
                text = (await http.get(url + "/metrics", timeout=30)).text
                for ln in text.splitlines():
                    if ln.startswith("kvboost_batch_kv_bytes "):
                        peak["batch_kv_bytes"] = max(peak["batch_kv_bytes"], float(ln.split()[-1]))
                await asyncio.sleep(0.5)

    before = scrape(url)
    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    sampler.cancel()
    after = scrape(url)
    await client.close()
    ok = [r for r in results if r and "error" not in r]
    steps = after["kvboost_decode_step_seconds_sum"] - before["kvboost_decode_step_seconds_sum"]
    dec_tokens = after["kvboost_decode_tokens_total"] - before["kvboost_decode_tokens_total"]
    n_steps = after["kvboost_decode_step_seconds_count"] - before["kvboost_decode_step_seconds_count"]
    return {"concurrency": concurrency, "requests": len(requests), "errors": len(requests) - len(ok),
            "error_samples": [r["error"] for r in results if r and "error" in r][:3], "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in ok) / wall, "decode_tok_s": dec_tokens / max(steps, 1e-9),
            "mean_batch": dec_tokens / max(n_steps, 1), "decode_busy_share": steps / wall,
            "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
            "e2e_p50": pct([r["e2e"] for r in ok], 50), "e2e_p99": pct([r["e2e"] for r in ok], 99),
            "prompt_tokens_mean": statistics.fmean(r["prompt"] for r in ok) if ok else 0,
            "cached_tokens_mean": statistics.fmean(r["cached"] for r in ok) if ok else 0,
            "cached_tokens_approximate_mean": statistics.fmean(r["approx"] for r in ok) if ok else 0,
            "batch_kv_bytes_peak": peak["batch_kv_bytes"], "texts": [r.get("text") for r in results]}


async def stall(url: str, requests: list, long_messages: list, max_tokens: int) -> dict[str, Any]:
    """Three requests decoding; then one long cold prompt arrives. The largest gap between the running
    requests' tokens while it is prefilled, against their median gap."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    times: list[list[float]] = [[], [], []]
    running = [asyncio.create_task(one(client, requests[i], max_tokens, times[i])) for i in range(3)]
    while min(len(t) for t in times) < 4:
        await asyncio.sleep(0.01)
    t_arrive = time.perf_counter()
    long = await one(client, long_messages, 2)
    t_first = t_arrive + long.get("ttft", 0.0)
    await asyncio.gather(*running)
    await client.close()
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if b > t_arrive and a < t_first]
    return {"long_prompt_tokens": long.get("prompt"), "long_ttft_s": long.get("ttft"), "long_error": long.get("error"),
            "median_gap_s": statistics.median(gaps) if gaps else None, "max_gap_during_long_prefill_s":
            max(during) if during else None}


def hf_sequential(model_dir: str, requests: list, max_tokens: int, threads: int | None = None) -> dict[str, Any]:
    """Plain HF greedy generation, one request at a time, full prefill (no reuse)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)  # the same thread count as the server, for a like-for-like baseline
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ttfts, e2es, tokens = [], [], 0

    class First:
        def __init__(self) -> None:
            self.n, self.t = 0, None

        def put(self, value: Any) -> None:
            self.n += 1
            if self.n == 2 and self.t is None:
                self.t = time.perf_counter()

        def end(self) -> None:
            pass

    t_all = time.perf_counter()
    for msgs in requests:
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        special = not (tok.bos_token and prompt.startswith(tok.bos_token))
        ids = tok(prompt, return_tensors="pt", add_special_tokens=special).input_ids
        streamer = First()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 streamer=streamer)
        e2es.append(time.perf_counter() - t0)
        ttfts.append((streamer.t or time.perf_counter()) - t0)
        tokens += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - t_all
    return {"requests": len(requests), "output_tok_s": tokens / wall, "ttft_p50": pct(ttfts, 50),
            "ttft_p99": pct(ttfts, 99), "e2e_p50": pct(e2es, 50), "e2e_p99": pct(e2es, 99)}


def decode_micro(model: str, threads: int | None, contexts: tuple[int, ...] = (64, 1024, 2000),
                 batches: tuple[int, ...] = (1, 4, 8), steps: int = 4) -> list[dict[str, Any]]:
    """Decode-step throughput of kvboost_core.serving.batch in process, by context length and batch size: what
    batching buys once the batch is full (the served figures also carry prefill and partial batches)."""
    import torch

    from kvboost_core import Segment
    from kvboost_core.serving.batch import BatchedDecoder, prefill
    from kvboost_rag.app.loading import load_engine

    if threads:
        torch.set_num_threads(threads)
    engine = load_engine(model).engine
    rows = []
    for ctx in contexts:
        pre = prefill(engine, [Segment(token_ids=[5] * ctx)], store_prefix=False)
        for b in batches:
            dec = BatchedDecoder(engine.driver, b)
            slots = [dec.add(pre.result.cache.keys, pre.result.cache.values, ctx, ctx + steps + 2) for _ in range(b)]
            dec.step({s: 5 for s in slots})  # warm-up
            t0 = time.perf_counter()
            for _ in range(steps):
                dec.step({s: 5 for s in slots})
            dt = (time.perf_counter() - t0) / steps
            rows.append({"context": ctx, "batch": b, "step_s": dt, "tok_s": b / dt,
                         "batch_kv_bytes": dec.nbytes, "per_request_kv_bytes": dec.used_bytes() // b})
            print(f"  decode step ctx {ctx} batch {b}: {dt * 1e3:.0f} ms, {b / dt:.1f} tok/s", flush=True)
    return rows


def run_server_levels(model: str, args: argparse.Namespace, max_batch: int, docs: list[str], requests: list,
                      tmp: Path) -> dict[str, Any]:
    import httpx
    from _server_fixture import running_server

    threads = ["--threads", str(args.threads)] if args.threads else []
    chunk = ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk is not None else []
    det = ["--no-deterministic"] if args.no_deterministic else []
    with running_server(tmp, "--model", model, "--served-model-name", "bench", "--max-batch", str(max_batch),
                        "--max-queue", "256", *threads, *chunk, *det, start_timeout=300) as srv:
        r = httpx.post(srv.v1 + "/documents", json={"documents": docs}, timeout=1200)
        r.raise_for_status()
        warm = r.json()
        asyncio.run(level(srv.url, requests[:2], 1, 2))  # warm-up: lazy initialisation off the clock
        out: dict[str, Any] = {"max_batch": max_batch, "warm": warm, "levels": []}
        # each level gets requests of its own (the same ones on both servers): a request repeated from an
        # earlier level would be an exact prefix hit and flatter its TTFT
        off = 3
        for c in args.levels:
            n = max(args.requests, c)
            res = asyncio.run(level(srv.url, requests[off:off + n], c, args.max_tokens))
            off += n
            print(f"  max-batch {max_batch} c={c}: {res['requests']} req, {res['errors']} err, "
                  f"{res['output_tok_s']:.1f} out tok/s, decode {res['decode_tok_s']:.1f} tok/s, "
                  f"TTFT p50 {res['ttft_p50']:.3f}s p99 {res['ttft_p99']:.3f}s, e2e p50 {res['e2e_p50']:.2f}s",
                  flush=True)
            out["levels"].append(res)
        if max_batch > 1:
            long_docs = [" ".join(docs).upper()]  # cold: upper case is never found among the warmed documents
            long_msgs = [{"role": "user", "content": long_docs[0][: args.long_chars]}]
            out["stall"] = asyncio.run(stall(srv.url, requests, long_msgs, args.max_tokens * 2))
            print(f"  stall: {out['stall']}", flush=True)
            out["rss_peak_bytes"] = _vm_hwm(srv.pid)
    return out


def _vm_hwm(pid: int) -> int | None:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct when present, else the demo model")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the servers' --prefill-chunk (default: theirs; 0: whole prompts, no chunked prefill)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-deterministic", action="store_true",
                   help="serve with --no-deterministic (plain batched decode; the baseline of what determinism costs)")
    p.add_argument("--decode-micro", action="store_true", help="also time batched decode steps in process")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    model = args.model or (str(SMOLLM) if (SMOLLM / "config.json").exists() else "demo")
    smol = model != "demo"
    # ~2K-token prompts with SmolLM2 (8 documents of 10 records); shorter with the 2K-context demo model
    args.requests = args.requests or 2 * max(args.levels)
    n_total = 3 + sum(max(args.requests, c) for c in args.levels)
    docs, requests = workload(None, n_total, 10 if smol else 3, 8 if smol else 6)
    args.max_tokens = args.max_tokens or (32 if smol else 24)
    args.long_chars = 3000 if smol else 1200
    import tempfile

    load = os.getloadavg()
    print(f"model {model}; load average {load[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    result: dict[str, Any] = {"model": model, "load_average_start": load, "cpus": os.cpu_count(),
                              "max_tokens": args.max_tokens, "deterministic": not args.no_deterministic}
    with tempfile.TemporaryDirectory() as tmp:
        result["batched"] = run_server_levels(model, args, 8 if max(args.levels) <= 8 else max(args.levels),
                                              docs, requests, Path(tmp))
        result["unbatched"] = run_server_levels(model, args, 1, docs, requests, Path(tmp))
    if not args.skip_hf:
        model_dir = str(SMOLLM) if smol else str(ROOT / "kvboost_rag/app/assets/demo_model")
        result["hf_sequential"] = hf_sequential(model_dir, requests[3: 3 + args.requests], args.max_tokens,
                                                 args.threads)
        print(f"  HF sequential: {result['hf_sequential']}", flush=True)
    if args.decode_micro:
        result["decode_step"] = decode_micro(model, args.threads)
    result["load_average_end"] = os.getloadavg()
    _compare(result)
    texts_kept = {k: result[k]["levels"] for k in ("batched", "unbatched")}
    for levels in texts_kept.values():
        for lv in levels:
            lv.pop("texts", None)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        _plot(result, args.plot)
    return 0


def _compare(result: dict[str, Any]) -> None:
    """Batched outputs against the unbatched server's (sequential greedy through the same reuse path), request
    by request: level by level, the two servers got the same requests."""
    same = total = 0
    for lb, lu in zip(result["batched"]["levels"], result["unbatched"]["levels"]):
        for a, b in zip(lb["texts"], lu["texts"]):
            if a is not None and b is not None:
                total += 1
                same += a == b
    lv1 = result["batched"]["levels"][0]
    top = result["batched"]["levels"][-1]
    by_c = {lv["concurrency"]: lv for lv in result["batched"]["levels"]}
    result["summary"] = {
        "outputs_identical_to_sequential": f"{same}/{total}",
        "errors": sum(lv["errors"] for k in ("batched", "unbatched") for lv in result[k]["levels"]),
        "requests": sum(lv["requests"] for k in ("batched", "unbatched") for lv in result[k]["levels"]),
        "decode_speedup_top_vs_single": top["decode_tok_s"] / max(lv1["decode_tok_s"], 1e-9),
        "output_speedup_top_vs_single": top["output_tok_s"] / max(lv1["output_tok_s"], 1e-9),
        "ttft_p50_c4_over_c1": by_c[4]["ttft_p50"] / lv1["ttft_p50"] if 4 in by_c else None,
    }
    print("summary:", json.dumps(result["summary"]), flush=True)


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("batched", "continuous batching"), ("unbatched", "--max-batch 1")):
        lv = result[key]["levels"]
        cs = [x["concurrency"] for x in lv]
        axes[0].plot(cs, [x["output_tok_s"] for x in lv], marker="o", label=label)
        axes[1].plot(cs, [x["ttft_p50"] for x in lv], marker="o", label=f"{label} p50")
        axes[1].plot(cs, [x["ttft_p99"] for x in lv], marker="x", linestyle="--", label=f"{label} p99")
    if "hf_sequential" in result:
        axes[0].axhline(result["hf_sequential"]["output_tok_s"], color="gray", linestyle=":", label="HF sequential")
    axes[0].set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    axes[1].set(xlabel="concurrency", ylabel="seconds", title="TTFT", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"kvboost-rag serve, {Path(result['model']).name}, CPU (load {result['load_average_start'][0]:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode at the weights' own precision against llama.cpp (issue #35): tokens/s, a 64-token answer end to end,
resident memory, side by side on the same ids.

Prompts are RAG chats of the eval split (``k`` documents and a question, ``apply_chat_template``'s ids). Every
method decodes exactly ``new_tokens`` greedy tokens with EOS masked, so all decode the same number of steps:

- ``hf``: plain HF in fp32 (a full prefill, then greedy steps on HF's own cache);
- ``kvboost_fp32`` / ``kvboost_fp16``: ``KVBoostRAG.generate`` at SmolLM2's defaults over documents warmed
  beforehand (``weights="fp32"`` / ``"fp16"``, :mod:`kvboost_core.model.weights`); ``total_s`` is the answer end to end;
- ``llamacpp``: llama-cpp-python on the GGUF the zoo converts the model from (Q4_1 for SmolLM2), fed the ids.

Decode tokens/s = (new_tokens - 1) / (time after the first token). Also the server's batched decoder in
process (deterministic, as served), one step over 1 and 8 rows of the first prompt's length, per precision. Methods alternate per prompt and round (one
warm-up call each, off the clock); medians over rounds, then prompts. Resident memory is measured in a fresh
subprocess per method: the process's RSS after loading and one short generation, minus the RSS of a process
that only imported torch. ``--ops`` adds the per-matmul timings behind the choice of kernel (fp32 MKL, FBGEMM
fp16, torch's weight-only int8/int4 packs, FBGEMM dynamic int8) at SmolLM2's shapes.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py --threads 1,2 --json benchmarks/results/decode.json \\
        --plot benchmarks/results/decode.png
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvboost_rag.app.bench import write_json
from kvboost_rag.app.bench.flops import speedup
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, messages

METHODS = ("hf", "kvboost_fp32", "kvboost_fp16", "llamacpp")


def rag_prompts(rag: Any, n: int, k: int, seed: int = 3) -> list[tuple[str, list[int]]]:
    """``n`` eval-split RAG chats of ``k`` documents: (prompt text, its ids)."""
    from kvboost_rag.app import rag_corpus as rc

    corpus = rc.load_corpus("eval")
    out = []
    for q, docs in rc.retrieval_sets(corpus, k, seed)[:n]:
        prompt = rag.chat_prompt(messages(q.question, [rc.doc_text(d) for d in docs]))
        out.append((prompt, list(rag.encode(prompt, rag.chat_add_special_tokens(prompt)))))
    return out


def hf_decode(model: Any, ids: Sequence[int], new: int, eos: Sequence[int]) -> dict[str, Any]:
    """Plain HF greedy, EOS masked (:func:`kvboost_rag.app.bench.rag.hf_steps`): TTFT, the time after the first
    token, the tokens."""
    from kvboost_rag.app.bench.rag import hf_steps

    _, tokens, ttft, total = hf_steps(model, ids, new, banned=eos)
    return {"ttft_s": ttft, "decode_s": total - ttft, "total_s": total, "tokens": tokens}


def kvboost_decode(rag: Any, prompt: str, ids: Sequence[int], new: int, eos: Sequence[int]) -> dict[str, Any]:
    """``KVBoostRAG.generate`` at its defaults, EOS masked (a logits processor)."""
    banned = sorted(eos)

    def no_eos(_: list[int], logits: Any) -> Any:
        logits[banned] = -float("inf")
        return logits

    t0 = time.perf_counter()
    res = rag.generate(prompt, max_new_tokens=new, add_special_tokens=rag.chat_add_special_tokens(prompt),
                       logits_processor=no_eos, store_prefix=False)
    total = time.perf_counter() - t0
    if list(res.prompt_token_ids) != list(ids):
        raise RuntimeError("prompt drift: kvboost tokenized the prompt differently from the chat template")
    ttft = res.stats["ttft_s"]  # from the call's start: finding the documents in the prompt is part of it
    return {"ttft_s": ttft, "decode_s": total - ttft, "total_s": total, "tokens": list(res.token_ids)}


def llamacpp_decode(llm: Any, ids: Sequence[int], new: int, eos: Sequence[int]) -> dict[str, Any]:
    """llama.cpp greedy from an empty context, EOS masked (a logits processor)."""
    import llama_cpp

    banned = sorted(eos)

    def no_eos(_: Any, scores: Any) -> Any:
        scores[banned] = -float("inf")
        return scores

    llm.reset()
    tokens: list[int] = []
    t0 = time.perf_counter()
    gen = llm.generate(list(ids), temp=0.0, logits_processor=llama_cpp.LogitsProcessorList([no_eos]))
    t1 = 0.0
    for tok in gen:
        tokens.append(int(tok))
        if len(tokens) == 1:
            t1 = time.perf_counter()
        if len(tokens) >= new:
            break
    gen.close()
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0, "tokens": tokens}


def resident_mb(method: str, model: str, threads: int) -> float | None:
    """RSS (MiB) a fresh process holds for ``method`` after loading and one short generation, over torch's own."""
    code = f"""
import json, torch, gc
torch.set_num_threads({threads})
def rss():
    gc.collect()
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) / 1024
base = rss()
from kvboost_rag.app.bench.decode import _load
run = _load({method!r}, {model!r}, {threads})
run()
print(json.dumps(rss() - base))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return None
    return float(out.stdout.strip().splitlines()[-1])


def _load(method: str, model: str, threads: int) -> Callable[[], Any]:
    """Load ``method`` alone; return a call that runs one short generation (for :func:`resident_mb`)."""
    if method == "llamacpp":
        import llama_cpp

        from kvboost_core import zoo

        llm = llama_cpp.Llama(model_path=str(zoo.gguf_path(zoo.MODELS[model])), n_ctx=4096, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        return lambda: llm.eval([1, 2, 3, 4])
    from kvboost_rag import KVBoostRAG

    weights = {"hf": "fp32", "kvboost_fp32": "fp32", "kvboost_fp16": "fp16"}[method]
    rag = KVBoostRAG.from_model_id(model, weights=weights)
    return lambda: rag.generate("Hello", max_new_tokens=4)


def batched_steps(engine: Any, context: int, batches: Sequence[int], steps: int = 6) -> list[dict[str, Any]]:
    """Decode-step throughput of the server's batched decoder (deterministic, as served) in process: ``b`` rows
    over a ``context``-token prompt each, tokens/s = b / step time (median of ``steps``)."""
    from kvboost_core import Segment
    from kvboost_core.serving.batch import BatchedDecoder, prefill

    pre = prefill(engine, [Segment(token_ids=[5] * context)], store_prefix=False)
    rows = []
    for b in batches:
        dec = BatchedDecoder(engine.driver, b, deterministic=True)
        slots = [dec.add(pre.result.cache.keys, pre.result.cache.values, context, context + steps + 2)
                 for _ in range(b)]
        dec.step({s: 5 for s in slots})  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            dec.step({s: 5 for s in slots})
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        rows.append({"context": context, "batch": b, "step_s": step, "tokens_per_s": b / step})
    return rows


def llamacpp_skip(model: str) -> str | None:
    """Why llama.cpp cannot run here, or None."""
    import importlib.util

    from kvboost_core import zoo

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (pip install llama-cpp-python: an optional benchmark extra)"
    if not zoo.is_zoo_name(model) or zoo.gguf_path(zoo.MODELS[model.lower()]) is None:
        return f"no GGUF installed for {model}"
    return None


def run(model: str, threads: int, n_prompts: int, k: int, new: int, rounds: int) -> dict[str, Any]:
    import torch

    from kvboost_core import zoo
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app import rag_corpus as rc

    torch.set_num_threads(threads)
    rags = {w: KVBoostRAG.from_model_id(model, weights=w) for w in ("fp32", "fp16")}
    docs = [rc.doc_text(d) for d in rc.load_corpus("eval").documents]
    for r in rags.values():
        r.warm_documents(docs, progress=False)
    prompts = rag_prompts(rags["fp32"], n_prompts, k)
    eos = sorted(rags["fp32"].engine.eos_token_ids)
    skip = llamacpp_skip(model)
    llm = None
    if skip is None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(zoo.gguf_path(zoo.MODELS[model.lower()])), n_ctx=8192, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
    calls: dict[str, Callable[[str, list[int]], dict[str, Any]]] = {
        "hf": lambda p, ids: hf_decode(rags["fp32"].engine.model, ids, new, eos),
        "kvboost_fp32": lambda p, ids: kvboost_decode(rags["fp32"], p, ids, new, eos),
        "kvboost_fp16": lambda p, ids: kvboost_decode(rags["fp16"], p, ids, new, eos),
    }
    if llm is not None:
        calls["llamacpp"] = lambda p, ids: llamacpp_decode(llm, ids, new, eos)
    for call in calls.values():  # warm-up, off the clock
        call(*prompts[0])
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in calls}
    for prompt, ids in prompts:
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                runs[name].append(call(prompt, ids))
        ref = runs["hf"][0]["tokens"]
        for name, rs in runs.items():
            per[name].append({"tokens_per_s": statistics.median((new - 1) / r["decode_s"] for r in rs),
                              "total_s": statistics.median(r["total_s"] for r in rs),
                              "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                              "same_tokens_as_hf": rs[0]["tokens"] == ref,
                              "same_first_8_as_hf": rs[0]["tokens"][:8] == ref[:8]})
    summary = {}
    for name, rows in per.items():
        summary[name] = {key: statistics.median(r[key] for r in rows) for key in ("tokens_per_s", "total_s",
                                                                                   "ttft_s")}
        summary[name]["same_tokens_as_hf"] = sum(r["same_tokens_as_hf"] for r in rows)
        summary[name]["same_first_8_as_hf"] = sum(r["same_first_8_as_hf"] for r in rows)
    batched = {w: batched_steps(r.engine, len(prompts[0][1]), (1, 8)) for w, r in rags.items()}
    return {"threads": threads, "prompt_tokens": [len(ids) for _, ids in prompts], "methods": summary,
            "per_prompt": per, "llamacpp_skipped": skip, "batched_decode": batched}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--k", type=int, default=12, help="documents per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also each method's resident memory (subprocesses)")
    ap.add_argument("--ops", action="store_true", help="also the per-matmul kernel timings")
    ap.add_argument("--machine", default=None, help="what else ran on the machine (recorded in the result)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"model": args.model, "new_tokens": args.new_tokens, "k": args.k,
                              "machine": args.machine,
                              "rounds": args.rounds, "command": "python benchmarks/bench_decode.py "
                              + " ".join(sys.argv[1:] if argv is None else argv), "runs": []}
    if args.ops:
        from kvboost_rag.app.bench.decode_ops import op_table

        result["ops"] = op_table(1)
    for t in (int(x) for x in args.threads.split(",")):
        r = run(args.model, t, args.prompts, args.k, args.new_tokens, args.rounds)
        result["runs"].append(r)
        m = r["methods"]
        for name, s in m.items():
            vs = f", {speedup(s['tokens_per_s'] / m['llamacpp']['tokens_per_s'])} than llama.cpp" \
                if "llamacpp" in m and name != "llamacpp" else ""
            print(f"{t} thread(s) {name:13s} {s['tokens_per_s']:6.1f} tok/s{vs}; {args.new_tokens}-token answer "
                  f"{s['total_s']:.2f} s (TTFT {s['ttft_s']:.2f} s); same tokens as HF {s['same_tokens_as_hf']}"
                  f"/{len(r['prompt_tokens'])}", flush=True)
        for w, rows in r["batched_decode"].items():
            print(f"{t} thread(s) batched decoder, weights {w}: " + ", ".join(
                f"batch {x['batch']} {x['tokens_per_s']:.1f} tok/s" for x in rows), flush=True)
    if args.memory:
        result["resident_mb"] = {m: resident_mb(m, args.model, 1) for m in METHODS if m != "hf"}
        print("resident MiB over torch's:", result["resident_mb"])
    write_json(args.json, result)
    if args.plot:
        from kvboost_rag.app.bench.decode_ops import plot

        plot(result, args.plot)
    return 0

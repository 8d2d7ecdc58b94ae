"""Multi-turn RAG chat against llama.cpp (issue 33, item 5): TTFT per turn, same prompt ids, side by side.

Each conversation (tune split) opens with a system turn and a user turn holding ``k`` retrieved documents and a
question; later turns ask follow-ups about the documents shown, and turns ``ADD_DOC_TURNS`` bring one new
document (their question's gold document). Every answer in the history is plain HF's greedy answer, so every
method sees exactly the ids ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives. The
methods run one after another over whole conversations (never two at once), TTFT counted from the call's start:

- ``hf``: ``model(ids, logits_to_keep=1)`` from scratch in fp32, plus the first token's argmax (the reference);
- ``llamacpp``: llama-cpp-python on the same GGUF, one ``Llama`` per conversation keeping the longest common
  prefix of what it evaluated; the ids are fed as ids, and HF's answer is evaluated after each turn, off the
  clock, as if llama.cpp had decoded it. Its prompt-eval counters confirm the reuse (``evaluated`` tokens);
- ``kvboost``: ``KVBoostRAG.generate`` as a chat turn (``chat_history``), the documents warmed first;
- ``exact``: the same with ``exact_turns=True``: every turn computed exactly (no document re-placed), so a
  follow-up waits for no backfill but turn 1 costs a full prefill;
- ``server``: ``kvboost-rag serve`` in a subprocess on loopback, through the ``openai`` client, streamed.

``--think`` is the user's think time between turns: ``0`` (the next turn at once: a follow-up then waits for its
history's backfill, on the clock) or ``backfill`` (the backfill is awaited off the clock). kvboost and the server
start from a fresh store for each think mode. Backfill CPU time: in process the backfill thread's CPU clock (all
of its compute at ``--threads 1``); through the server the server process's CPU time while it is awaited
(``backfill`` mode only). llama-cpp-python is an optional benchmark extra: without it ``llamacpp`` is skipped and
the result says why.

    python benchmarks/bench_chat_turns.py --threads 1 --json benchmarks/results/chat_turns.json \\
        --plot benchmarks/results/chat_turns.png
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kvboost_rag.app.bench.chat_server import serve, server_conversation
from kvboost_rag.app.bench.flops import speedup
from kvboost_rag.app.bench.prefix import common_prefix
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, SYSTEM
from kvboost_rag.app.bench.turn_plot import finish_turn_figure
from kvboost_rag.app.rag_corpus import questions_by_doc

METHODS = ("hf", "llamacpp", "kvboost", "exact", "server")
REUSE = ("kvboost", "exact", "server")  # the kvboost methods, as their result keys start
LABELS = {"kvboost": "kvboost", "exact": "kvboost exact turns", "server": "server"}
THINK = ("0", "backfill")
ADD_DOC_TURNS = (4,)  # follow-ups that bring one new document


def plan_conversation(corpus: Any, k: int, turns: int, seed: int) -> list[tuple[list[Any], Any]]:
    """Per turn: (documents added in this turn's user message, the question). Turn 1 shows ``k`` documents, its
    question's gold among them; turns in ``ADD_DOC_TURNS`` add their question's gold document, not shown before;
    the others ask about a document already shown."""
    rng = random.Random(seed)
    by_doc = questions_by_doc(corpus)
    shown: list[Any] = []
    asked: set[str] = set()
    plan: list[tuple[list[Any], Any]] = []
    for t in range(1, turns + 1):
        fresh = [d for d in corpus.documents if d not in shown and by_doc.get(d.id)]
        if t == 1 or (t in ADD_DOC_TURNS and fresh):
            gold = rng.choice(fresh)
            docs = [gold]
            if t == 1:
                rest = [d for d in corpus.documents if d is not gold]
                docs += rng.sample(rest, min(k - 1, len(rest)))
                rng.shuffle(docs)
            shown += docs
            pool = [q for q in by_doc[gold.id] if q.id not in asked] or by_doc[gold.id]
        else:
            every = [q for d in shown for q in by_doc.get(d.id, [])]
            pool = [q for q in every if q.id not in asked] or every
            docs = []
        q = rng.choice(pool)
        asked.add(q.id)
        plan.append((docs, q))
    return plan


def user_turn(docs: list[str], question: str) -> str:
    if not docs:
        return f"Question: {question}"
    return "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def llamacpp_skip_reason(model: str) -> str | None:
    """Why ``llamacpp`` cannot run here (None: it can)."""
    from kvboost_core import zoo

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (pip install llama-cpp-python: an optional benchmark extra)"
    if not zoo.is_zoo_name(model):
        return f"no GGUF known for --model {model} (only the zoo's models ship one)"
    if zoo.gguf_path(zoo.MODELS[model.lower()]) is None:
        return f"the GGUF of {model} is not installed ({zoo.MODELS[model.lower()].install_hint})"
    return None


def hf_conversation(model: Any, tokenizer: Any, plan: list[tuple[list[Any], Any]], max_new: int,
                    eos: set[int]) -> list[dict[str, Any]]:
    """HF's pass: per turn the messages, prompt ids, TTFT and greedy answer (the history of every method)."""
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.rag import hf_greedy

    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for docs, q in plan:
        messages.append({"role": "user", "content": user_turn([rc.doc_text(d) for d in docs], q.question)})
        ids = chat_ids(tokenizer, messages)
        ref = hf_greedy(model, tokenizer, ids, max_new, eos)
        out.append({"messages": list(messages), "ids": ids, "ttft_s": ref.ttft_s, "tokens": ref.tokens,
                    "text": ref.text, "new_doc": bool(docs)})
        messages.append({"role": "assistant", "content": ref.text})
    return out


def llamacpp_conversation(path: str, threads: int, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=8192, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)

    def evaluated() -> int:  # tokens llama.cpp has decoded so far (its counters lag until a synchronize)
        llama_cpp.llama_synchronize(llm._ctx.ctx)
        p = llama_cpp.llama_perf_context(llm._ctx.ctx)
        return int(p.n_p_eval + p.n_eval)

    llm.eval(refs[0]["ids"][:32])  # off the clock: first-call costs, as HF's warm-up forward
    llm.reset()
    out = []
    for ref in refs:
        ids, before = ref["ids"], evaluated()
        prefix = common_prefix(list(llm._input_ids), ids)
        t0 = time.perf_counter()
        gen = llm.generate(ids, temp=0.0)
        tok = next(gen)
        ttft = time.perf_counter() - t0
        gen.close()
        n = evaluated() - before  # == len(ids) - prefix when llama.cpp reused its prefix (all of it but one)
        out.append({"ttft_s": ttft, "evaluated": n, "prefix": prefix, "reused": 1 - n / len(ids),
                    "top1": tok == ref["tokens"][0]})
        llm.eval(ref["tokens"][:-1])  # off the clock: the answer as if llama.cpp had decoded it
    llm.close()
    return out


def kvboost_conversation(rag: Any, refs: list[dict[str, Any]], think: str) -> list[dict[str, Any]]:
    from kvboost_core import cache_counts

    eng = rag.engine
    out: list[dict[str, Any]] = []
    marks: list[int] = []  # backfill results seen after each turn
    for ref in refs:
        prompt = rag.chat_prompt(ref["messages"])
        special = rag.chat_add_special_tokens(prompt)
        res = rag.generate(prompt, chat_history=rag.chat_history(ref["messages"]), add_special_tokens=special,
                           max_new_tokens=len(ref["tokens"]))
        if res.prompt_token_ids != ref["ids"]:
            raise RuntimeError("prompt drift: kvboost tokenized the chat differently from HF's chat template")
        marks.append(len(eng.backfill_results))
        if think == "backfill" and not rag.engine.wait_backfill(timeout=3600):
            raise RuntimeError("the backfill did not finish within an hour")
        c = cache_counts(res.stats)
        out.append({"ttft_s": res.stats["ttft_s"], "exact": c.cached / len(ref["ids"]),
                    "approximate": c.approximate / len(ref["ids"]), "top1": res.token_ids[:1] == ref["tokens"][:1],
                    "same_answer": res.text.strip() == ref["text"].strip()})
    rag.engine.wait_backfill(timeout=3600)  # the last turn's backfill, off the clock
    marks.append(len(eng.backfill_results))
    results = eng.backfill_results  # the latest 64 jobs: more than a conversation's turns
    for i, row in enumerate(out):  # turn t's backfill runs between its end and turn t+1's first token
        done = results[marks[i]:marks[i + 1]]
        row["backfill_cpu_s"] = sum(r.cpu_s for r in done)  # the backfill thread's own CPU time
        row["backfill_wall_s"] = sum(r.seconds for r in done)
    return out


def summarize(rows: list[dict[str, Any]], thinks: list[str]) -> list[dict[str, Any]]:
    """Per turn number: medians over conversations; speedups are ratios of those medians (full / reuse)."""
    def med(values: list[Any]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    out = []
    for t in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == t]
        hf = med([r["hf"]["ttft_s"] for r in rs])
        p: dict[str, Any] = {"turn": t, "new_doc": any(r["new_doc"] for r in rs), "conversations": len(rs),
                             "prompt_tokens": med([r["prompt_tokens"] for r in rs]), "hf_ttft_s": hf}
        ll = [r["llamacpp"] for r in rs if r.get("llamacpp")]
        llama = med([x["ttft_s"] for x in ll])
        if ll:
            p["llamacpp"] = {"ttft_s": llama, "vs_hf": hf / llama if hf and llama else None,
                             "reused": med([x["reused"] for x in ll]), "top1": sum(x["top1"] for x in ll)}
        for method in REUSE:
            for think in thinks:
                key = f"{method}_think_{think}"
                xs = [r[key] for r in rs if r.get(key)]
                if not xs:
                    continue
                ttft = med([x["ttft_s"] for x in xs])
                p[key] = {"ttft_s": ttft, "exact": med([x["exact"] for x in xs]),
                          "vs_hf": hf / ttft if hf and ttft else None,
                          "vs_llamacpp": llama / ttft if llama and ttft else None,
                          "backfill_cpu_s": med([x.get("backfill_cpu_s") for x in xs]),
                          "backfill_wall_s": med([x.get("backfill_wall_s") for x in xs]),
                          "same_answer": sum(x["same_answer"] for x in xs),
                          "top1": sum(x.get("top1", x["same_answer"]) for x in xs)}
        out.append(p)
    return out


def _cell(p: dict[str, Any], key: str) -> str:
    x = p.get(key)
    if not x:
        return ""
    s = f"{x['ttft_s']:.2f} s ({x['exact']:.0%} exact"
    bf = x.get("backfill_cpu_s")
    s += f", backfill {bf:.2f} s CPU)" if bf is not None else ")"
    return s + "<br>" + speedup(x["vs_hf"] or 0) + " vs HF" + (
        f", {speedup(x['vs_llamacpp'])} vs llama.cpp" if x.get("vs_llamacpp") else "")


def _shown(thinks: list[str]) -> list[str]:
    """The result keys the table and plot show: exact turns at think 0 only, where they differ (with think time
    they wait for nothing either way; those figures stay in the JSON)."""
    return [f"{m}_think_{t}" for t in thinks for m in REUSE if not (m == "exact" and t != "0")]


def _label(key: str, sep: str = ", think ") -> str:
    """``exact_think_0`` -> ``kvboost exact turns, think 0``."""
    method, think = key.split("_think_")
    return f"{LABELS[method]}{sep}{think}"


def markdown_table(result: dict[str, Any]) -> str:
    """The per-turn table: TTFT of each method, exact share, backfill CPU, speedups vs HF and llama.cpp."""
    pt, thinks = result["per_turn"], result["think"]
    keys = [k for k in _shown(thinks) if any(k in p for p in pt)]
    head = ["turn", "tokens", "HF full prefill", "llama.cpp prefix reuse", *[_label(k) for k in keys]]
    rows = []
    for p in pt:
        ll = p.get("llamacpp")
        rows.append([f"{p['turn']}" + (" (+doc)" if p["new_doc"] and p["turn"] > 1 else ""),
                     f"{p['prompt_tokens']:,.0f}", f"{p['hf_ttft_s']:.2f} s",
                     f"{ll['ttft_s']:.2f} s ({ll['reused']:.0%} reused)<br>{speedup(ll['vs_hf'])} vs HF" if ll
                     else "skipped", *[_cell(p, k) for k in keys]])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    n = sum(p["conversations"] for p in pt)
    first = [f"llama.cpp {sum(p['llamacpp']['top1'] for p in pt)}/{n}"] if any("llamacpp" in p for p in pt) else []
    first += [f"{_label(k, ' (think ')}) {sum(p[k]['top1'] for p in pt if k in p)}/{n}"
              for k in keys if not k.startswith("server")]
    whole = [f"{_label(k, ' (think ')}) {sum(p[k]['same_answer'] for p in pt if k in p)}/{n}" for k in keys]
    notes = [f"- Same first token as HF's greedy answer: {', '.join(first)}."] if first else []
    notes += [f"- Same whole answer as HF's: {', '.join(whole)}."] if whole else []
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows] + ([""] + notes if notes else []))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = result["per_turn"]
    turns = [p["turn"] for p in pt]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(turns, [p["hf_ttft_s"] for p in pt], marker="o", label="HF full prefill")
    if any("llamacpp" in p for p in pt):
        line, = ax.plot(turns, [p.get("llamacpp", {}).get("ttft_s") for p in pt], marker="o",
                        label="llama.cpp prefix reuse")
        bx.plot(turns, [p.get("llamacpp", {}).get("reused") for p in pt], marker="o", color=line.get_color(),
                label="llama.cpp (prefix reused)")
    for key in _shown(result["think"]):
        if any(key in p for p in pt):
            label = _label(key)
            line, = ax.plot(turns, [p.get(key, {}).get("ttft_s") for p in pt], marker="o", label=label)
            bx.plot(turns, [p.get(key, {}).get("exact") for p in pt], marker="o", color=line.get_color(),
                    label=label)
    finish_turn_figure(fig, ax, bx, xlabel="turn", share_label="share of the prompt reused exactly",
                       title=f"RAG chat turns vs llama.cpp: {result['model']}, {result['threads']} "
                             f"thread{'s' if result['threads'] > 1 else ''}", path=path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_chat_turns", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--k", type=int, default=8, help="documents in the first turn")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="of HF's answers (the history)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--think", default=",".join(THINK), help="0 and/or backfill, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    thinks = [t for t in args.think.split(",") if t]
    if not set(methods) <= set(METHODS) or "hf" not in methods or not set(thinks) <= set(THINK) or not thinks:
        ap.error(f"--methods: hf plus any of {', '.join(METHODS)}; --think: any of {', '.join(THINK)}")
    if min(args.turns, args.conversations, args.k, args.threads) < 1:
        ap.error("--turns, --conversations, --k and --threads must be >= 1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_core import zoo
    from kvboost_rag.app import rag_corpus as rc

    torch.set_num_threads(args.threads)
    folder = zoo.resolve(args.model) if zoo.is_zoo_name(args.model) else args.model
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = {int(t) for t in ([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
    eos.add(int(tok.eos_token_id))
    corpus = rc.load_corpus("tune")
    plans = [plan_conversation(corpus, args.k, args.turns, args.seed + c) for c in range(args.conversations)]
    docs = list(dict.fromkeys(rc.doc_text(d) for plan in plans for ds, _ in plan for d in ds))
    skipped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": args.model, "threads": args.threads, "split": "tune", "k": args.k,
                              "turns": args.turns, "conversations": args.conversations,
                              "max_new_tokens": args.max_new_tokens, "add_doc_turns": list(ADD_DOC_TURNS),
                              "methods": methods, "think": thinks, "skipped": skipped, "rows": rows}

    def save(stage: str) -> None:
        result["per_turn"] = summarize(rows, thinks)
        print(f"[{stage}] done", flush=True)
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(result, indent=1))

    with torch.inference_mode():  # off the clock: first-call costs (llama.cpp and kvboost have theirs too)
        model(input_ids=torch.tensor([chat_ids(tok, [{"role": "user", "content": "Hello."}])]))
    refs = [hf_conversation(model, tok, plan, args.max_new_tokens, eos) for plan in plans]
    for c, conv in enumerate(refs):
        rows += [{"conversation": c, "turn": t, "prompt_tokens": len(r["ids"]), "new_doc": r["new_doc"],
                  "hf": {"ttft_s": r["ttft_s"], "answer": r["text"]}} for t, r in enumerate(conv, start=1)]
    del model
    gc.collect()
    save("hf")
    by_key = {(r["conversation"], r["turn"]): r for r in rows}

    def fill(key: str, c: int, out: list[dict[str, Any]]) -> None:
        for t, x in enumerate(out, start=1):
            by_key[(c, t)][key] = x

    if "llamacpp" in methods:
        reason = llamacpp_skip_reason(args.model)
        if reason:
            skipped["llamacpp"] = reason
        else:
            path = str(zoo.gguf_path(zoo.MODELS[args.model.lower()]))
            for c, conv in enumerate(refs):
                fill("llamacpp", c, llamacpp_conversation(path, args.threads, conv))
            save("llamacpp")
    for think in thinks:
        for method in ("kvboost", "exact"):
            if method not in methods:
                continue
            from kvboost_rag import KVBoostRAG

            # a fresh store: nothing left from another think mode or method
            rag = KVBoostRAG.from_model_id(args.model, exact_turns=method == "exact")
            rag.warm_documents(docs, progress=False)
            for c, conv in enumerate(refs):
                fill(f"{method}_think_{think}", c, kvboost_conversation(rag, conv, think))
            rag.engine.close_backfill(60)
            del rag
            gc.collect()
            save(f"{method}, think {think}")
        if "server" in methods:
            import httpx

            with serve(args.model, args.threads) as (url, pid):
                r = httpx.post(url + "/v1/documents", json={"documents": docs}, timeout=3600)
                r.raise_for_status()
                for c, conv in enumerate(refs):
                    fill(f"server_think_{think}", c, server_conversation(url, pid, args.model, conv, think))
            save(f"server, think {think}")
    print(markdown_table(result))
    if args.plot_path:
        plot(result, args.plot_path)
    return 0

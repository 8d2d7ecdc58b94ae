"""The ``kvboost-rag`` command line: demo, warm, fidelity, calibrate and bench.

    kvboost-rag demo [--model M] [--questions N] [--top-k K]
    kvboost-rag warm --model M --docs DIR|FILE.jsonl --store disk:/path [--store redis://...] [--allow-degraded]
    kvboost-rag fidelity [--model M] [--json] [--recompute-ratio R] [--check-layer C]
    kvboost-rag calibrate [--model M] [--max-kl X] [--write]   (the cheapest CacheBlend setting meeting X)
    kvboost-rag bench ...            (arguments are forwarded to kvboost_rag.app.bench.ttft)
    kvboost-rag adapt --out DIR ...  (train a reader adapter: kvboost_rag.app.adapt; adapt --help)

``--model`` defaults to SmolLM2-135M-Instruct (the short name ``smollm2-135m-instruct``, kvboost_core.zoo) in every
command whose answer matters: demo, warm, fidelity, calibrate and serve. ``--model demo`` is the embedded
2M-parameter model (kvboost_rag/app/assets/demo_model): fast, what the tests run on, not a real answer; the demo
falls back to the tiny random model of :mod:`kvboost_rag.tiny` when that asset is missing.

A mistake in the arguments or inputs prints one ``kvboost-rag: error: ...`` line and exits 2; ``--debug``
shows the traceback instead. Nothing heavy (torch, transformers) is imported before a command runs, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.cli_util import (
    REPAIRS,
    STORE_FORMS,
    Parser,
    UserError,
    fidelity_table,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    ratio,
    repairs_list,
    run_guarded,
    store_spec,
)
from kvboost_rag.app.cli_warm import run_warm
from kvboost_rag.app.loading import DEMO, Loaded, fidelity_prompts, has_demo_data, load_engine, set_threads

REAL_MODEL = "smollm2-135m-instruct"  # the real instruct model the demo runs on (kvboost_core.zoo)


# ---------------------------------------------------------------------------------------------- demo
@dataclass
class DemoRow:
    question: str
    expected: str | None
    answer: str
    answer_full: str
    ttft_reuse_s: float
    ttft_full_s: float
    reuse_ratio: float
    documents: int


def _demo_workload(loaded: Loaded, n: int) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(corpus texts, [(question, expected answer or None)])."""
    if has_demo_data(loaded.model_dir):
        assert loaded.model_dir is not None
        corpus = [d["text"] for d in dd.load_corpus(loaded.model_dir)]
        # single-hop first: a retriever keyed on the question's words finds their one gold document; a
        # two-hop question's second document shares no words with it.
        qs = sorted(dd.load_heldout(loaded.model_dir), key=lambda q: q["hops"])
        return corpus, [(q["question"], q["answer"]) for q in qs[:n]]
    from kvboost_rag.tiny import synthetic_facts

    questions = ["Where does Dana live?", "What does Chen do on weekends?", "When was Alice born?",
                 "Who lives in Portvale?", "What is the job of Emeka?"]
    return synthetic_facts(20), [(q, None) for q in (questions * (n // len(questions) + 1))[:n]]


def _build_chain(llm: Any, corpus: Sequence[str], top_k: int) -> Any:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import PromptTemplate
    from langchain_kvboost import KVHashEmbeddings

    docs = [Document(page_content=t) for t in corpus]
    store = FAISS.from_documents(docs, KVHashEmbeddings())
    prompt = PromptTemplate.from_template(dd.PROMPT_TEMPLATE)
    return create_retrieval_chain(store.as_retriever(search_kwargs={"k": top_k}),
                                  create_stuff_documents_chain(llm, prompt))


def _is_chat_model(model: str) -> bool:
    """A zoo short name, or a model whose tokenizer has a chat template (read from its files, no torch)."""
    from kvboost_core import zoo

    if zoo.is_zoo_name(model):
        return True
    path = Path(model)
    if model == DEMO or not path.is_dir():
        return False
    if (path / "chat_template.jinja").is_file():
        return True
    cfg = path / "tokenizer_config.json"
    return cfg.is_file() and "chat_template" in json.loads(cfg.read_text())


def run_demo(args: argparse.Namespace) -> int:
    if _is_chat_model(args.model):  # the retrieval chain over ChatKVBoost (kvboost_rag.app.demo_chat)
        from kvboost_rag.app import demo_chat

        return demo_chat.run(args.model, args.questions, args.top_k or 12, args.max_new_tokens or 40,
                             progress=False if args.no_progress else None)
    args.top_k, args.max_new_tokens = args.top_k or 4, args.max_new_tokens or 12
    from kvboost_core import KVEngine
    from kvboost_rag import KVBoostRAG

    try:
        from langchain_kvboost import KVBoostLLM
    except ImportError as exc:
        raise SystemExit(f"the demo needs LangChain: pip install 'kvboost-rag[langchain]' ({exc})") from exc
    t_start = time.perf_counter()
    loaded = load_engine(args.model, allow_tiny=True)
    corpus, questions = _demo_workload(loaded, args.questions)
    llm = KVBoostLLM(engine=loaded.engine, max_tokens=args.max_new_tokens, stop=["\n"], model_id=loaded.label)
    print(f"model: {loaded.label}; corpus: {len(corpus)} documents; {len(questions)} questions; top-k {args.top_k}")
    report = llm.warm_documents(corpus, progress=not args.no_progress)
    print(f"warmed {report.warmed} documents ({report.tokens} tokens, {report.bytes / 2**20:.1f} MiB) "
          f"in {report.seconds:.1f} s")
    chain = _build_chain(llm, corpus, args.top_k)
    # The baseline: a second engine on the same weights with an empty store, so its prefill computes every
    # token (no warmed documents, no exact-prefix hits from the reuse run's stored prefixes).
    full = KVBoostRAG(KVEngine(loaded.engine.model, loaded.engine.tokenizer))
    _warm_up(chain, full)
    rows = [_demo_question(chain, llm, full, q, expected, args.max_new_tokens) for q, expected in questions]
    for i, row in enumerate(rows, 1):
        _print_row(i, row)
    _print_summary(rows, time.perf_counter() - t_start)
    return 0


def _warm_up(chain: Any, full: Any) -> None:
    """One untimed call on each path, so lazy initialisation does not land in the first TTFT."""
    chain.invoke({"input": "warm-up"})
    full.generate(dd.build_prompt(["warm-up"], "warm-up"), max_new_tokens=1, store_prefix=False)


def _demo_question(chain: Any, llm: Any, full: Any, question: str, expected: str | None,
                   max_new_tokens: int) -> DemoRow:
    out = chain.invoke({"input": question})
    stats = dict(llm.last_stats)
    # The same prompt the chain built (stuff-documents joins page contents with "\n\n").
    prompt = dd.build_prompt([d.page_content for d in out["context"]], question)
    ref = full.generate(prompt, max_new_tokens=max_new_tokens, stop="\n", repair="full", store_prefix=False)
    return DemoRow(question, expected, str(out["answer"]).strip(), ref.text.strip(), float(stats["ttft_s"]),
                   ref.ttft_s, float(stats["reuse_ratio"]), int(stats.get("documents", 0)))


def _mark(answer: str, expected: str | None) -> str:
    if expected is None:
        return "n/a"
    return "right" if dd.is_correct(answer, expected) else f"wrong (expected {expected!r})"


def _print_row(i: int, r: DemoRow) -> None:
    print(f"\n[{i}] Q: {r.question}")
    print(f"    A (reuse): {r.answer!r} -> {_mark(r.answer, r.expected)}")
    print(f"    A (full):  {r.answer_full!r} -> {_mark(r.answer_full, r.expected)}")
    print(f"    TTFT reuse {r.ttft_reuse_s * 1e3:.1f} ms | full prefill {r.ttft_full_s * 1e3:.1f} ms | "
          f"reuse ratio {r.reuse_ratio:.0%} | documents found {r.documents}")


def _print_summary(rows: Sequence[DemoRow], seconds: float) -> None:
    print("\nSummary")
    graded = [r for r in rows if r.expected is not None]
    if graded:
        acc_reuse = sum(dd.is_correct(r.answer, r.expected or "") for r in graded) / len(graded)
        acc_full = sum(dd.is_correct(r.answer_full, r.expected or "") for r in graded) / len(graded)
        print(f"  accuracy: with reuse {acc_reuse:.0%}, full prefill {acc_full:.0%} ({len(graded)} questions)")
    if rows:
        same = sum(dd.normalize_answer(r.answer) == dd.normalize_answer(r.answer_full) for r in rows)
        print(f"  fidelity: reuse gave the same answer as full prefill on {same}/{len(rows)} questions "
              "(logit KL/top-1: kvboost-rag fidelity)")
        ratio = statistics.median(r.ttft_full_s / max(r.ttft_reuse_s, 1e-9) for r in rows)
        print(f"  median TTFT: reuse {statistics.median(r.ttft_reuse_s for r in rows) * 1e3:.1f} ms, "
              f"full {statistics.median(r.ttft_full_s for r in rows) * 1e3:.1f} ms "
              f"(full/reuse {ratio:.2f}x); mean reuse ratio {statistics.fmean(r.reuse_ratio for r in rows):.0%}")
    print(f"  total {seconds:.1f} s")


# ---------------------------------------------------------------------------------------------- fidelity
def run_fidelity(args: argparse.Namespace) -> int:
    loaded = load_engine(args.model)
    docs, prompts = fidelity_prompts(loaded, args.prompts)
    loaded.engine.warm(docs)
    knobs = {k: v for k, v in (("recompute_ratio", args.recompute_ratio), ("check_layer", args.check_layer))
             if v is not None}
    rep = loaded.engine.verify(prompts, repairs=tuple(args.repairs), max_new_tokens=args.max_new_tokens, **knobs)
    if args.json:
        print(rep.to_json(indent=2))
    else:
        print(f"fidelity of {loaded.label}: {len(prompts)} prompts of reordered warmed documents vs full prefill")
        print(fidelity_table(rep.summary()))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from kvboost_core import zoo
    from kvboost_core.tuning.calibrate import calibrate, save_defaults

    if args.write and zoo.is_zoo_name(args.model):
        raise UserError(f"--write: {args.model}'s defaults are shipped with kvboost_core.zoo and rewritten on every "
                        "load; calibrate a copy of its folder (--model PATH) to keep your own")
    if args.write and args.model != DEMO and not Path(args.model).is_dir():
        raise UserError("--write needs a local model directory (the settings are saved beside the weights)")
    loaded = load_engine(args.model)
    docs, prompts = fidelity_prompts(loaded, args.prompts)
    loaded.engine.warm(docs)
    cal = calibrate(loaded.engine, prompts, max_kl=args.max_kl, min_top1=args.min_top1)
    print(f"calibration of {loaded.label}: {len(prompts)} prompts of reordered warmed documents, target mean KL "
          f"<= {args.max_kl} and top-1 >= {args.min_top1:.0%}")
    print(f"{'check layer':>12}{'ratio':>7}{'est. cost':>11}{'mean KL':>10}{'top-1':>8}{'recomputed':>12}")
    for t in cal.trials:
        print(f"{t.check_layer:>12}{t.recompute_ratio:>7.2f}{t.cost:>11.1%}{t.mean_kl:>10.4f}{t.top1_agree:>8.0%}"
              f"{t.recomputed_share:>12.0%}")
    if not cal.met:
        best = f"check_layer={cal.check_layer}, recompute_ratio={cal.recompute_ratio}"
        print(f"-> no setting met the target (the lowest KL tried: {best})"
              + ("; nothing written" if args.write else ""))
        print(f"kvboost-rag: error: calibration of {loaded.label} did not meet mean KL <= {args.max_kl} and top-1 "
              f">= {args.min_top1:.0%} at any setting tried{'; nothing was written' if args.write else ''}",
              file=sys.stderr)
        return 1
    print(f"-> check_layer={cal.check_layer}, recompute_ratio={cal.recompute_ratio} (meets the target)")
    if args.write:
        assert loaded.model_dir is not None  # checked above: a local directory
        print(f"wrote {save_defaults(loaded.model_dir, cal)}")
    return 0


# ---------------------------------------------------------------------------------------------- bench
def run_bench(rest: Sequence[str]) -> int:
    """``bench`` and its subcommands (``bench rag``, ``bench multiturn``) parse their own arguments."""
    from kvboost_rag.app.bench.ttft import main as bench_main

    return int(bench_main(list(rest)) or 0)


def run_adapt(rest: Sequence[str]) -> int:
    if "--block" in rest:  # the block adapter has its own trainer
        from kvboost_rag.app.adapt_block import main as block_main

        return int(block_main(list(rest)) or 0)
    from kvboost_rag.app.adapt import main as adapt_main

    return int(adapt_main(list(rest)) or 0)


# ---------------------------------------------------------------------------------------------- parser
_MODEL_HELP = (f"a short name, HF model directory or hub id (default {REAL_MODEL}); '{DEMO}' is the embedded "
               "2M-parameter model: fast (the tests use it), not a real answer")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvboost-rag", description="KV cache reuse for RAG on local HF models.",
               epilog="Errors print one line; add --debug (anywhere) for the full traceback.")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="{demo,warm,fidelity,calibrate,bench,adapt,serve}",
                           parser_class=Parser)

    d = sub.add_parser("demo", help="LangChain RAG chat over the bundled English corpus on a real instruct model: "
                                    "answers and TTFT with reuse vs plain HF full prefill")
    d.add_argument("--model", default=REAL_MODEL,
                   help=f"a short name, HF model directory or hub id of a chat model (default {REAL_MODEL}); "
                        f"'{DEMO}' runs the older demo on the embedded 2M-parameter model")
    d.add_argument("--questions", type=positive_int, default=3,
                   help="held-out questions to ask before the follow-up turns (default 3)")
    d.add_argument("--top-k", type=positive_int, default=None,
                   help="documents retrieved per question (default 12 for chat models, 4 for the demo model)")
    d.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens generated per answer (default 40 for chat models, 12 for the demo model)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar while warming")

    w = sub.add_parser("warm", help="warm documents into a KV store (memory, disk and/or Redis tiers)")
    w.add_argument("--model", default=REAL_MODEL, help=_MODEL_HELP)
    w.add_argument("--docs", required=True, help="a directory of .txt files or a .jsonl file with a 'text' field")
    w.add_argument("--store", required=True, action="append", type=store_spec, metavar="SPEC",
                   help=f"a store tier: {STORE_FORMS}; repeat for several tiers (a memory tier is always first)")
    w.add_argument("--chunk-size", type=positive_int, default=128, help="tokens per cached chunk (default 128)")
    w.add_argument("--batch-size", type=positive_int, default=8, help="documents warmed per batch (default 8)")
    w.add_argument("--allow-degraded", action="store_true",
                   help="succeed even when a configured tier (e.g. Redis) is unavailable; by default that "
                        "exits with status 1")
    w.add_argument("--no-progress", action="store_true", help="no progress bar (it only shows on a terminal)")

    f = sub.add_parser("fidelity", help="reuse strategies vs full prefill on reordered documents")
    f.add_argument("--model", default=REAL_MODEL, help=_MODEL_HELP)
    f.add_argument("--prompts", type=positive_int, default=12, help="prompts to compare (default 12)")
    f.add_argument("--repairs", type=repairs_list, default=repairs_list("none,selective,cacheblend"),
                   metavar="LIST", help=f"comma-separated repair modes from {{{','.join(REPAIRS)}}} "
                                        "(default none,selective,cacheblend)")
    f.add_argument("--max-new-tokens", type=positive_int, default=8,
                   help="greedy tokens compared per prompt (default 8)")
    f.add_argument("--recompute-ratio", type=ratio, default=None,
                   help="CacheBlend recompute ratio in [0, 1] (default: the engine's)")
    f.add_argument("--check-layer", type=nonnegative_int, default=None,
                   help="CacheBlend check layer (default: the engine's)")
    f.add_argument("--json", action="store_true", help="print the report as JSON")

    c = sub.add_parser("calibrate", help="the cheapest CacheBlend setting meeting a KL target, for this model")
    c.add_argument("--model", default=REAL_MODEL, help=_MODEL_HELP)
    c.add_argument("--prompts", type=positive_int, default=20, help="prompts to calibrate on (default 20)")
    c.add_argument("--max-kl", type=nonnegative_float, default=0.05,
                   help="mean KL against full prefill to meet (default 0.05)")
    c.add_argument("--min-top1", type=ratio, default=0.95,
                   help="top-1 agreement with full prefill to meet, in [0, 1] (default 0.95)")
    c.add_argument("--write", action="store_true",
                   help="save the result as kvboost.json beside the weights (KVEngine.from_pretrained then uses it "
                        "by default); only a setting that met the target is written. Exit status 1 when none did")

    for sp in (d, w, f, c):
        sp.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 for the embedded demo model, else torch's default)")

    sub.add_parser("bench", help="benchmarks (arguments forwarded to kvboost_rag.app.bench.ttft; bench --help)",
                   add_help=False)
    sub.add_parser("adapt", help="train a reader adapter by distillation (arguments forwarded to "
                                 "kvboost_rag.app.adapt; adapt --help)", add_help=False)
    from kvboost_rag.app.server.main import (
        add_arguments as serve_arguments,  # argparse only; FastAPI loads later
    )

    serve_arguments(sub.add_parser("serve", help="OpenAI-compatible server with continuous batching"))
    return p


def run_serve(args: argparse.Namespace) -> int:
    from kvboost_rag.app.server import main as server

    with server.sigterm_exits_zero():  # SIGTERM: exit status 0, while loading as while serving
        sock = server.preflight(args)  # the arguments, --model and the port, before torch and the weights load
        try:
            set_threads(args.threads, args.model)  # its worker threads copy it
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        return server.run(args, sock)


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return run_serve(args)
    set_threads(args.threads, args.model)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "warm":
        return run_warm(args, load_engine)
    if args.command == "fidelity":
        return run_fidelity(args)
    if args.command == "calibrate":
        return run_calibrate(args)
    raise UserError(f"unknown command {args.command!r}")  # argparse rejects these first


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere on the line
    if argv and argv[0] in ("bench", "adapt"):  # each owns its parser; its errors are one line too
        run = run_bench if argv[0] == "bench" else run_adapt
        return run_guarded(lambda: run(argv[1:]), debug=debug)
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: _run(args), debug=debug)


__all__ = ["build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())

"""``kvboost-rag demo``: a stock LangChain retrieval chain over ``ChatKVBoost`` on a real instruct model.

Two parts, each answer compared with plain HF on exactly the same chat (a full prefill of the ids the chat
template gives, greedy on HF's own cache):

1. **Retrieved documents at any position.** A FAISS retriever over the held-out English corpus of
   :mod:`kvboost_rag.app.rag_corpus` picks each question's documents; only the documents those questions
   retrieve are warmed (computed once, as at ingestion). ``ChatKVBoost`` finds them inside the rendered chat
   and reuses their KV in the engine's default mode for the model. Each row is labelled from the engine's own
   stats: "exact" when every reused token is exact, else "approximate (...)" with the repair that ran.
2. **A multi-turn conversation.** Over documents that were not warmed: its first turn is computed in full,
   and every later turn reuses the whole earlier conversation as an exact prefix, so its answers are those of
   a full prefill and only the time changes.

The summary prints, for every turn, the answer each way, right or wrong, identical or not, TTFT each way (the
fastest of as many runs each way, a few where a full prefill is cheap; with the machine's load and whether the
timings are noisy: see :mod:`kvboost_rag.app.demo_timing`), when warming pays off, and where the time went.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvboost_rag.app import demo_timing as dt
from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.bench.rag import SYSTEM, first_sentence, hf_greedy
from kvboost_rag.app.fmt import seconds, speedup

HUMAN = "Documents:\n\n{context}\n\nQuestion: {input}"
FIGURES = "docs/figures.md in the repository (the docs site's \"Measured figures\" page)"
TRADE_OFF = ("CacheBlend trade-off: re-placed documents are reused approximately; the fewer tokens it recomputes, "
             "the faster, and the more answers change. Accuracy, same-answer rate and speed per setting, "
             "measured on held-out questions: " + FIGURES)


@dataclass(slots=True)
class Turn:
    """One answer with reuse and the same chat through plain HF."""

    part: str
    question: str
    gold: str
    answer: str
    answer_full: str
    correct: bool
    correct_full: bool
    reuse_runs: list[float]  # TTFT runs with reuse, seconds (the answer's own call first)
    full_runs: list[float]  # TTFT runs of plain HF full prefill, seconds
    mode: str
    reuse_ratio: float
    prompt_tokens: int
    documents: int

    @property
    def ttft_s(self) -> float:
        """The fastest reuse run: the one least disturbed by the machine's load."""
        return min(self.reuse_runs)

    @property
    def ttft_full_s(self) -> float:
        return min(self.full_runs)

    @property
    def runs(self) -> str:
        """Runs per side (as many both ways)."""
        return str(min(len(self.reuse_runs), len(self.full_runs)))

    @property
    def identical(self) -> bool:
        return self.answer.strip() == self.answer_full.strip()

    @property
    def same_first_sentence(self) -> bool:
        return first_sentence(self.answer) == first_sentence(self.answer_full)


@dataclass(slots=True)
class Clock:
    """Where the demo's time went, phase by phase, in the order the phases ran."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, s: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + s


def reuse_mode(stats: Mapping[str, Any]) -> str:
    """How the prompt's reused KV relates to a full prefill, read from the engine's stats (never assumed)."""
    approx = int(stats.get("reused_approx", 0)) + int(stats.get("reused_repaired", 0))
    if approx == 0 and int(stats.get("reused_block", 0)) > 0:
        return "block-exact (the block adapter's own prefill)"
    if approx == 0:
        return "exact" if float(stats.get("reuse_ratio", 0.0)) > 0 else "no reuse (computed in full)"
    repair = str(stats.get("repair", "?"))
    how = {"cacheblend": f"CacheBlend r={stats.get('recompute_ratio')}", "none": "re-rotated, no repair"}.get(
        repair, repair)
    if stats.get("reader"):
        how += " + reader adapter"
    return f"approximate ({how})"


def build_chain(chat: Any, corpus: rc.RagCorpus, top_k: int) -> tuple[Any, Any]:
    """(retrieval chain, retriever): FAISS over every corpus document, the chat prompt the benchmarks use."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_kvboost import KVHashEmbeddings

    docs = [Document(page_content=rc.doc_text(d), metadata={"id": d.id}) for d in corpus.documents]
    retriever = FAISS.from_documents(docs, KVHashEmbeddings()).as_retriever(search_kwargs={"k": top_k})
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", HUMAN)])
    return create_retrieval_chain(retriever, create_stuff_documents_chain(chat, prompt)), retriever


def reference(chat: Any, messages: Sequence[Mapping[str, str]], max_new_tokens: int) -> Any:
    """Plain HF greedy on exactly the ids ``ChatKVBoost`` builds for ``messages``."""
    rag = chat.rag
    prompt = rag.chat_prompt([dict(m) for m in messages])
    ids = rag.encode(prompt, rag.chat_add_special_tokens(prompt))
    eng = rag.engine
    return hf_greedy(eng.model, eng.tokenizer, ids, max_new_tokens, set(eng.eos_token_ids))


def timed_reference(chat: Any, messages: Sequence[Mapping[str, str]], lc_messages: Any, max_new_tokens: int,
                    clock: Clock, what: str) -> tuple[Any, list[dt.Probe], list[float]]:
    """The reference answer first, then, where one full prefill is cheap, more one-token runs each way
    (``lc_messages``: the same chat as ``ChatKVBoost`` takes it): (reference, reuse probes, full runs)."""
    t0 = time.perf_counter()
    ref = reference(chat, messages, max_new_tokens)
    clock.add(f"the same {what} by full prefill (reference)", time.perf_counter() - t0)
    t0 = time.perf_counter()
    probes, fulls = dt.alternate(dt.extra_runs(ref.ttft_s), lambda: dt.reuse_probe(chat, lc_messages),
                                 lambda: float(reference(chat, messages, 1).ttft_s))
    clock.add("repeated TTFT runs (timing only)", time.perf_counter() - t0)
    return ref, probes, [ref.ttft_s, *fulls]


def ask_chain(chain: Any, retriever: Any, chat: Any, q: rc.CorpusQuestion, max_new_tokens: int,
              clock: Clock) -> Turn:
    # The chat the chain will send (stuff-documents joins page contents with "\n\n"), for plain HF and the
    # timing runs, all before the chain's own call (the runs store nothing; the call stores its prefix).
    context = "\n\n".join(d.page_content for d in retriever.invoke(q.question))
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": HUMAN.format(context=context, input=q.question)}]
    ref, probes, fulls = timed_reference(chat, messages, messages, max_new_tokens, clock, "answers")
    t0 = time.perf_counter()
    out = chain.invoke({"input": q.question})
    clock.add("answers with reuse", time.perf_counter() - t0)
    stats = dict(chat.last_stats)
    runs, full_runs = dt.paired(float(stats["ttft_s"]), dt.probe_key(chat), probes, fulls)
    answer = str(out["answer"]).strip()
    return Turn("retrieval", q.question, q.answer, answer, ref.text.strip(), rc.is_correct(answer, q),
                rc.is_correct(ref.text, q), runs, full_runs, reuse_mode(stats),
                float(stats["reuse_ratio"]), len(ref.ids), int(stats.get("documents", 0)))


def conversation(corpus: rc.RagCorpus, exclude: set[str], n_docs: int = 4
                 ) -> tuple[list[rc.CorpusDoc], list[rc.CorpusQuestion]]:
    """Documents none of part 1's questions retrieved (so nothing re-placed), and follow-up questions on them:
    two about one document, then one about another, in corpus order (deterministic)."""
    free = [d for d in corpus.documents if d.id not in exclude]
    by_doc: dict[str, list[rc.CorpusQuestion]] = {}
    for q in corpus.questions:
        by_doc.setdefault(q.doc_id, []).append(q)
    first = next((d for d in free if len(by_doc.get(d.id, [])) >= 2), None)
    if first is None:
        raise RuntimeError("the corpus has no unretrieved document with two questions for the follow-up")
    second = next((d for d in free if d.id != first.id and by_doc.get(d.id)), None)
    docs = [first] + ([second] if second else [])
    docs += [d for d in free if d not in docs][: max(0, n_docs - len(docs))]
    questions = by_doc[first.id][:2] + (by_doc[second.id][:1] if second else [])
    return docs, questions


def follow_up(chat: Any, corpus: rc.RagCorpus, exclude: set[str], max_new_tokens: int, clock: Clock
              ) -> Iterator[Turn]:
    """The follow-up turns, each yielded as soon as it is answered both ways."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    docs, questions = conversation(corpus, exclude)
    history: list[Any] = [SystemMessage(SYSTEM)]
    plain: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i, q in enumerate(questions, 1):
        text = (HUMAN.format(context="\n\n".join(rc.doc_text(d) for d in docs), input=q.question) if i == 1
                else f"Question: {q.question}")
        history.append(HumanMessage(text))
        plain.append({"role": "user", "content": text})
        ref, probes, fulls = timed_reference(chat, plain, history, max_new_tokens, clock, "turns")
        t0 = time.perf_counter()
        msg = chat.invoke(history)
        clock.add("follow-up turns with reuse", time.perf_counter() - t0)
        stats = dict(chat.last_stats)
        runs, full_runs = dt.paired(float(stats["ttft_s"]), dt.probe_key(chat), probes, fulls)
        t0 = time.perf_counter()
        chat.rag.engine.wait_backfill()  # exact history (backfill="auto") is computed between turns, not meanwhile
        clock.add("exact history between turns (backfill)", time.perf_counter() - t0)
        answer = str(msg.content).strip()
        yield Turn(f"chat turn {i}", q.question, q.answer, answer, ref.text.strip(), rc.is_correct(answer, q),
                   rc.is_correct(ref.text, q), runs, full_runs, reuse_mode(stats),
                   float(stats["reuse_ratio"]), len(ref.ids), 0)
        # The conversation continues with the answer the user saw (reuse's), in both histories alike.
        history.append(AIMessage(answer))
        plain.append({"role": "assistant", "content": answer})


class _DropMissWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "were not warmed" not in str(record.msg)


@contextmanager
def _quiet_misses() -> Iterator[None]:
    """Drop only the "documents not warmed" warning of the ``kvboost`` logger while the block runs."""
    log, filt = logging.getLogger("kvboost"), _DropMissWarnings()
    log.addFilter(filt)
    try:
        yield
    finally:
        log.removeFilter(filt)


def _mark(ok: bool) -> str:
    return "right" if ok else "wrong"


def print_turn(i: int, t: Turn) -> None:
    print(f"\n[{i}] {t.part}: {t.question}   (gold: {t.gold})")
    print(f"    reuse: {t.answer!r} -> {_mark(t.correct)}")
    print(f"    full:  {t.answer_full!r} -> {_mark(t.correct_full)}")
    same = "identical" if t.identical else ("same first sentence" if t.same_first_sentence else "answers differ")
    print(f"    {t.prompt_tokens} prompt tokens, reused {t.reuse_ratio:.0%} ({t.mode}) | TTFT reuse "
          f"{seconds(t.ttft_s)}, full prefill {seconds(t.ttft_full_s)} (fastest of {t.runs} each): "
          f"{speedup(t.ttft_full_s, t.ttft_s)} | {same}")


def summary_table(turns: Sequence[Turn]) -> list[str]:
    head = ["#", "part", "reused KV", "reuse", "full", "identical", "TTFT reuse", "TTFT full", "speedup", "runs"]
    rows = [[str(i), t.part, t.mode, _mark(t.correct), _mark(t.correct_full),
             "yes" if t.identical else ("first sentence" if t.same_first_sentence else "no"),
             seconds(t.ttft_s), seconds(t.ttft_full_s), speedup(t.ttft_full_s, t.ttft_s), t.runs]
            for i, t in enumerate(turns, 1)]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *rows]]


def print_summary(turns: Sequence[Turn], clock: Clock, total_s: float, machine: dt.Machine,
                  warmed: tuple[float, int] = (0.0, 0)) -> None:
    """``warmed``: (seconds, documents) of the warming, for when it pays off."""
    print("\nSummary (answers with reuse against plain HF full prefill of the same chat, greedy)")
    for line in summary_table(turns):
        print("  " + line)
    for line in dt.noise_lines(machine, [(t.reuse_runs, t.full_runs) for t in turns]):
        print("  " + line)
    exact = [t for t in turns if t.mode == "exact"]
    approx = [t for t in turns if t.mode.startswith("approximate")]
    if exact:
        print(f"  exact reuse: {sum(t.identical for t in exact)}/{len(exact)} answers identical to full prefill")
    if approx:
        print(f"  approximate reuse: {sum(t.identical for t in approx)}/{len(approx)} identical, "
              f"{sum(t.correct for t in approx)}/{len(approx)} right (full prefill "
              f"{sum(t.correct_full for t in approx)}/{len(approx)}); a few questions say little about accuracy: "
              f"see {FIGURES}")
    saved = {t.question: t.ttft_full_s - t.ttft_s for t in turns if t.part == "retrieval"}
    print("\n" + dt.WARM_PAYS)
    for line in dt.payoff_lines(warmed[0], warmed[1], saved):
        print(line)
    print("\n" + TRADE_OFF)
    print(f"\nWhere the time went ({total_s:.0f} s in all):")
    for name, s in clock.phases.items():
        print(f"  {name:<48} {s:6.1f} s")


def run(model: str, questions: int, top_k: int, max_new_tokens: int, progress: bool | None = None) -> int:
    try:
        from langchain_kvboost import ChatKVBoost
    except ImportError as exc:
        raise SystemExit(f"the demo needs LangChain: pip install 'kvboost-rag[langchain]' ({exc})") from exc
    t_start, load_start = time.perf_counter(), dt.load_average()
    clock = Clock()
    chat = ChatKVBoost.from_model_id(model, device="cpu", max_tokens=max_new_tokens)
    corpus = rc.load_corpus("eval")
    qs = list(corpus.questions[::max(1, len(corpus.questions) // max(questions, 1))][:questions])
    chain, retriever = build_chain(chat, corpus, top_k)
    clock.add("load the model, index the corpus", time.perf_counter() - t_start)
    cfg = chat.rag.engine.config
    print(f"model: {model}; engine default: repair {cfg.repair}, recompute_ratio {cfg.recompute_ratio}, "
          f"check layer {cfg.check_layer}; corpus: {len(corpus.documents)} held-out documents; "
          f"{len(qs)} questions, top-k {top_k}")

    t0 = time.perf_counter()
    needed: dict[str, str] = {}  # only what the questions retrieve is warmed (what ingestion would have done)
    for q in qs:
        for d in retriever.invoke(q.question):
            needed.setdefault(str(d.metadata["id"]), d.page_content)
    print(f"warming the {len(needed)} documents these questions retrieve (at ingestion you warm every document "
          "once)", flush=True)
    report = dt.warm(chat, list(needed.values()), progress, log=lambda line: print(line, flush=True))
    clock.add(f"warm the {len(needed)} retrieved documents (once)", time.perf_counter() - t0)
    print(f"warmed {report.warmed} documents ({report.tokens} tokens, {report.bytes / 2**20:.1f} MiB) in "
          f"{report.seconds:.1f} s: about one prefill per document, paid once (the summary says when it pays off)")

    t0 = time.perf_counter()
    # Lazy initialisation stays out of the first TTFT: one token each way, on a prompt with no documents.
    warm_up = [{"role": "user", "content": "warm-up"}]
    chat.rag.generate(chat.rag.chat_prompt(warm_up), max_new_tokens=1, store_prefix=False)
    reference(chat, warm_up, 1)
    clock.add("warm-up calls (lazy initialisation)", time.perf_counter() - t0)

    print("\nPart 1: retrieved documents, reused wherever the retriever puts them")
    turns: list[Turn] = []
    for q in qs:
        turns.append(ask_chain(chain, retriever, chat, q, max_new_tokens, clock))
        print_turn(len(turns), turns[-1])
    print("\nPart 2: a conversation over documents that were never warmed. Turn 1 computes them in full (no faster "
          "than full prefill); every later turn reuses the whole earlier conversation as an exact prefix.")
    with _quiet_misses():  # those documents are unwarmed on purpose: no "not warmed" warning
        for t in follow_up(chat, corpus, set(needed), max_new_tokens, clock):
            turns.append(t)
            print_turn(len(turns), t)
    print_summary(turns, clock, time.perf_counter() - t_start, dt.machine(load_start), (report.seconds, len(needed)))
    return 0

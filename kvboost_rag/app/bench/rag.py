"""Real-model RAG quality benchmark: does KV reuse change the answers?

Each question's prompt is a chat: a system turn, then one user turn holding ``k`` retrieved documents (the gold
one and distractors, shuffled) and the question, rendered by the model's own chat template. The reference is a
plain HF full prefill of exactly the ids ``apply_chat_template``'s text gives, decoded greedily with HF's own
cache. Every repair setting runs through the transparent path (``KVBoostRAG.generate`` on the same prompt text,
as ``ChatKVBoost`` does), with nothing stored between questions (``store_prefix=False``), so no answer depends on
an earlier one. Reported per setting:

- ``accuracy``: the gold answer (or an alias) is in the answer;
- ``same_answer``: the normalized first sentence equals full prefill's;
- ``greedy_match``: all ``max_new_tokens`` greedy tokens equal full prefill's (up to EOS);
- ``kl`` / ``top1``: first-token KL(full || reuse) and argmax agreement;
- ``reuse`` / ``recompute``: shares of prompt tokens served from the cache as is / recomputed by repair;
- ``ttft_s`` median, and ``speedup`` = full TTFT / reuse TTFT (N.NNx faster), both measured side by side.

The chat format is :mod:`.rag_chat`'s; ``--ttft-k`` runs :mod:`.rag_ttft` (TTFT of long chats) instead, and the
``block`` setting's answers are checked by :mod:`kvboost_rag.app.block_reference`.

    kvboost-rag bench rag --split eval --k 12 --json benchmarks/results/rag_quality.json
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvboost_rag.app.bench import write_json
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, SYSTEM, first_sentence, messages, user_message
from kvboost_rag.app.bench.rag_report import plot_curve, print_table

if TYPE_CHECKING:
    import torch

# name -> engine kwargs for KVBoostRAG.generate; "full" is the engine's own full recompute (must equal HF)
SETTINGS: dict[str, dict[str, Any]] = {
    "engine-full": {"repair": "full"},
    "none": {"repair": "none"},
    "cacheblend-0.15": {"repair": "cacheblend", "recompute_ratio": 0.15},
    "cacheblend-0.3": {"repair": "cacheblend", "recompute_ratio": 0.3},
    "cacheblend-0.5": {"repair": "cacheblend", "recompute_ratio": 0.5},
    "cacheblend-0.7": {"repair": "cacheblend", "recompute_ratio": 0.7},
    # the ideas measured on the tune split (README, "Real-model answers")
    "c3r30": {"repair": "cacheblend", "recompute_ratio": 0.3, "check_layer": 3},
    "c3r50": {"repair": "cacheblend", "recompute_ratio": 0.5, "check_layer": 3},
    "q30": {"repair": "cacheblend", "recompute_ratio": 0.3, "query_tokens": 8},
    "q15": {"repair": "cacheblend", "recompute_ratio": 0.15, "query_tokens": 32},
    "m50": {"repair": "cacheblend", "recompute_ratio": 0.1, "recompute_mass": 0.5},
    "m80": {"repair": "cacheblend", "recompute_ratio": 0.15, "recompute_mass": 0.8},
    # progressive CacheBlend: a second check layer narrows the first one's tokens (pNN-MM@L: NN% up to layer L,
    # MM% above it)
    "p70-30@8": {"repair": "cacheblend", "recompute_ratio": 0.7, "recheck_layer": 8, "recheck_ratio": 0.3},
    "p50-15@8": {"repair": "cacheblend", "recompute_ratio": 0.5, "recheck_layer": 8, "recheck_ratio": 0.15},
    "c3p70-30@10": {"repair": "cacheblend", "recompute_ratio": 0.7, "check_layer": 3, "recheck_layer": 10,
                    "recheck_ratio": 0.3},
    "default": {},
}
# the adapted model's own plain HF full prefill of the same ids (run with --block-adapter and --adapted-full)
ADAPTED_FULL = "adapted-full"


@dataclass(slots=True)
class Reference:
    ids: list[int]
    logits: torch.Tensor  # (vocab,) fp32, first generated token
    tokens: list[int]
    text: str
    ttft_s: float


def hf_steps(model: Any, ids: Sequence[int], max_new_tokens: int, *, stop: Collection[int] = (),
             banned: Collection[int] = ()) -> tuple[Any, list[int], float, float]:
    """Plain HF: a full prefill of ``ids`` (logits of the last position only), then greedy steps on HF's cache,
    ``banned`` ids masked at every step, ending after a ``stop`` id or ``max_new_tokens`` tokens: (the first
    logits, float32; the tokens; seconds to the first logits; seconds in all)."""
    import torch

    from kvboost_core.model.driver import output_cache

    mask = torch.tensor(sorted(banned), dtype=torch.long, device=model.device)

    def pick(logits: torch.Tensor) -> int:
        return int((logits.index_fill(0, mask, -torch.inf) if len(mask) else logits).argmax())

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        ttft = time.perf_counter() - t0
        cache, tokens = output_cache(out), [pick(logits)]
        while tokens[-1] not in stop and len(tokens) < max_new_tokens:
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=model.device), cache=cache, use_cache=True)
            cache = output_cache(out)
            tokens.append(pick(out.logits[0, -1]))
    return logits, tokens, ttft, time.perf_counter() - t0


def hf_greedy(model: Any, tokenizer: Any, ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> Reference:
    """Plain HF greedy (:func:`hf_steps`), ending at EOS: the reference every reuse path is compared with."""
    logits, tokens, ttft, _ = hf_steps(model, ids, max_new_tokens, stop=eos)
    text = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
    return Reference(list(ids), logits, tokens, text, ttft)


@dataclass(slots=True)
class Row:
    question: str
    gold: str
    setting: str
    answer: str
    correct: bool
    same_answer: bool
    greedy_match: bool
    kl: float
    top1: bool
    reuse: float
    recompute: float
    ttft_s: float
    # block adapter rows: the greedy answer equals the independent HF block construction's (None: not checked)
    exact: bool | None = None


@dataclass(slots=True)
class Summary:
    setting: str
    questions: int
    accuracy: float
    same_answer: float
    greedy_match: float
    kl_mean: float
    top1: float
    reuse: float
    recompute: float
    ttft_s: float
    speedup: float  # full TTFT / reuse TTFT, medians of the same questions
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(setting: str, rows: Sequence[Row], full_ttft: float, full: Sequence[Row] | None = None) -> Summary:
    """One setting's figures; with ``full`` (the reference rows of the same questions) also the paired accuracy
    difference with its bootstrap 95% interval and McNemar's p, and Wilson intervals of the agreement rates."""
    from kvboost_rag.app.bench.stats import paired_accuracy, rate_with_ci

    n = len(rows)
    ttft = statistics.median(r.ttft_s for r in rows)
    extra: dict[str, Any] = {}
    if full is not None and setting != "full":
        if [r.question for r in full] != [r.question for r in rows]:
            raise ValueError(f"setting {setting}: rows are not paired with the reference's questions")
        extra["paired"] = paired_accuracy([r.correct for r in full], [r.correct for r in rows]).to_dict()
        extra["same_answer_ci"] = rate_with_ci([r.same_answer for r in rows])
        extra["greedy_match_ci"] = rate_with_ci([r.greedy_match for r in rows])
    checked = [r.exact for r in rows if r.exact is not None]
    if checked:
        extra["exact_vs_hf_block"] = rate_with_ci(checked)
    return Summary(setting, n, sum(r.correct for r in rows) / n, sum(r.same_answer for r in rows) / n,
                   sum(r.greedy_match for r in rows) / n, statistics.fmean(r.kl for r in rows),
                   sum(r.top1 for r in rows) / n, statistics.fmean(r.reuse for r in rows),
                   statistics.fmean(r.recompute for r in rows), ttft, full_ttft / ttft, extra)


def summaries(rows: dict[str, list[Row]]) -> dict[str, dict[str, Any]]:
    """Every setting against the base model's full prefill; with an ``adapted-full`` arm, the block setting also
    against it (``block_cost``: what block reading costs the adapted model, apart from what its weights change)."""
    from kvboost_rag.app.bench.stats import paired_accuracy

    full_ttft = statistics.median(r.ttft_s for r in rows["full"])
    out = {s: asdict(summarize(s, r, full_ttft, rows["full"])) for s, r in rows.items()}
    if "block" in rows and ADAPTED_FULL in rows:  # both paired with "full"'s questions by summarize
        out["block"]["extra"]["block_cost"] = paired_accuracy([r.correct for r in rows[ADAPTED_FULL]],
                                                              [r.correct for r in rows["block"]]).to_dict()
    return out


def run(rag: Any, split: str, k: int, n_questions: int | None, settings: dict[str, dict[str, Any]],
        max_new_tokens: int = 32, seed: int = 0, log: Any = print, start: int = 0,
        block_rag: Any = None, adapted_full: bool = False) -> dict[str, Any]:
    """Every question through HF full prefill (the reference) and each setting; with ``block_rag`` (a
    KVBoostRAG whose engine has a block adapter) also the ``block`` setting: the adapted model served at
    ``repair="none"``, its greedy answer checked against the independent HF block construction
    (kvboost_core.lora.block_prefill) and its accuracy compared with the base model's full prefill.
    ``adapted_full`` (with ``block_rag``): also the adapted model's plain HF full prefill of the same ids, the
    reference of block reading's own cost."""
    if adapted_full and block_rag is None:
        raise ValueError("adapted_full needs block_rag (the adapted model)")
    from kvboost_core.tuning.fidelity import kl_divergence
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.block_reference import served_as_reference

    corpus = rc.load_corpus(split)
    sets = rc.retrieval_sets(corpus, k, seed)[start:][: n_questions or None]
    engine = rag.engine
    texts = [rc.doc_text(d) for d in corpus.documents]
    t0 = time.perf_counter()
    rag.warm_documents(texts, progress=False)
    warm_s = time.perf_counter() - t0
    if block_rag is not None:
        block_rag.warm_documents(texts, progress=False)
    for owner in (rag, block_rag):  # an evicted document would be computed, not reused: the arms would lie
        evicted = 0 if owner is None else _evictions(owner.engine.store.stats())
        if evicted:
            raise RuntimeError(f"warming the {split} split's {len(texts)} documents evicted {evicted} store entries "
                               f"(max_cache_bytes={owner.engine.config.max_cache_bytes:,}); the reuse arms would "
                               "compute evicted documents instead of reusing them. Pass --cache-bytes larger")
    eos = set(engine.eos_token_ids)
    rows: dict[str, list[Row]] = {"full": []}
    for s in settings:
        rows[s] = []
    if block_rag is not None:
        rows["block"] = []
    if adapted_full:
        rows[ADAPTED_FULL] = []
    encoded: dict = {}  # the adapted model's isolated document encodings, for the HF block construction
    prompt_tokens = []
    for i, (q, docs) in enumerate(sets):
        prompt = rag.chat_prompt(messages(q.question, [rc.doc_text(d) for d in docs]))
        special = rag.chat_add_special_tokens(prompt)
        ids = rag.encode(prompt, special)
        prompt_tokens.append(len(ids))
        ref = hf_greedy(engine.model, engine.tokenizer, ids, max_new_tokens, eos)
        ref_sentence = first_sentence(ref.text)
        rows["full"].append(Row(q.question, q.answer, "full", ref.text, rc.is_correct(ref.text, q), True, True, 0.0,
                                True, 0.0, 1.0, ref.ttft_s))
        if adapted_full:
            own = hf_greedy(block_rag.engine.model, block_rag.engine.tokenizer, ids, max_new_tokens, eos)
            rows[ADAPTED_FULL].append(Row(
                q.question, q.answer, ADAPTED_FULL, own.text, rc.is_correct(own.text, q),
                first_sentence(own.text) == ref_sentence, own.tokens == ref.tokens,
                kl_divergence(ref.logits, own.logits), int(own.logits.argmax()) == int(ref.logits.argmax()), 0.0,
                1.0, own.ttft_s))
        runs = [(name, rag, kw) for name, kw in settings.items()]
        if block_rag is not None:
            runs.append(("block", block_rag, {"repair": "none"}))
        for name, owner, kw in runs:
            res = owner.generate(prompt, max_new_tokens=max_new_tokens, add_special_tokens=special,
                                 store_prefix=False, **kw)
            if res.prompt_token_ids != ids:
                raise RuntimeError(f"prompt drift in setting {name}: the transparent path changed the ids")
            assert res.first_logits is not None
            first_kl = kl_divergence(ref.logits, res.first_logits)
            top1 = int(res.first_logits.argmax()) == int(ref.logits.argmax())
            st = res.stats
            n = st["prompt_tokens"]
            exact = None
            if name == "block":
                exact = served_as_reference(owner, prompt, special, res.prompt_token_ids, res.token_ids,
                                            max_new_tokens, encoded)
            rows[name].append(Row(
                q.question, q.answer, name, res.text, rc.is_correct(res.text, q),
                first_sentence(res.text) == ref_sentence, list(res.token_ids) == ref.tokens, first_kl, top1,
                (st["reused_exact"] + st.get("reused_block", 0) + st["reused_approx"]) / n, st["recomputed"] / n,
                st["ttft_s"], exact))
        if log:
            log(f"[{i + 1}/{len(sets)}] {len(ids)} tok  gold={q.answer!r}  full={ref.text[:70]!r}")
            for s in rows:
                if s == "full":
                    continue
                r = rows[s][-1]
                mark = "" if r.exact is None else (" [block-exact]" if r.exact else " [NOT EXACT]")
                log(f"    {s:<20} {'=' if r.same_answer else 'x'}{'+' if r.correct else '-'} {r.answer[:70]!r}{mark}")
    engine_info = {"reader_adapter": engine.config.reader_adapter, "recompute_ratio": engine.config.recompute_ratio,
                   "check_layer": engine.config.check_layer, "select": engine.config.select,
                   "repair": engine.config.repair}
    if block_rag is not None:
        meta = block_rag.engine.block.meta
        engine_info["block_adapter"] = {"path": block_rag.engine.config.block_adapter, "rank": meta.rank,
                                        "trained": {k: v for k, v in meta.trained.items() if k != "loss_curve"}}
    return {"split": split, "k": k, "questions": len(sets), "max_new_tokens": max_new_tokens, "seed": seed,
            "prompt_tokens_median": statistics.median(prompt_tokens), "warm_s": warm_s, "engine": engine_info,
            "settings": {s: kw for s, kw in settings.items()}, "summary": summaries(rows),
            "rows": {s: [asdict(x) for x in r] for s, r in rows.items()}}


def _evictions(stats: Any) -> int:
    """Evictions in a store's stats (a tiered store nests its tiers' stats)."""
    if isinstance(stats, dict):
        return int(stats.get("evictions", 0) or 0) + sum(_evictions(v) for k, v in stats.items() if k != "evictions")
    return 0


def merge_runs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs over disjoint question slices (same split, k and settings): rows are concatenated
    and every summary is recomputed from them (TTFT medians and speedups included)."""
    if not parts:
        raise ValueError("parts must hold at least one run")
    first = parts[0]
    rows: dict[str, list[Row]] = {}
    for part in parts:
        if (part["split"], part["k"], list(part["rows"])) != (first["split"], first["k"], list(first["rows"])):
            raise ValueError("parts differ in split, k or settings")
        for s, rs in part["rows"].items():
            rows.setdefault(s, []).extend(Row(**r) for r in rs)
    out = dict(first, questions=sum(p["questions"] for p in parts),
               prompt_tokens_median=statistics.median(p["prompt_tokens_median"] for p in parts))
    out["summary"] = summaries(rows)
    out["rows"] = {s: [asdict(x) for x in r] for s, r in rows.items()}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.cli_util import Parser, nonnegative_int, positive_int

    ap = Parser(prog="kvboost-rag bench rag", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name, a local HF folder or a hub id")
    ap.add_argument("--split", choices=rc.SPLITS, default="eval",
                    help="tune: for tuning; eval: held out; heldout: the larger held-out set (288 questions, issue #24); "
                         "dev, dev2: for choices; test, test2: read once (--final)")
    ap.add_argument("--k", type=positive_int, default=12, help="retrieved documents per question (gold included)")
    ap.add_argument("--questions", type=positive_int, default=None, help="first N questions (default: all)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy tokens per answer (default 32)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    ap.add_argument("--warm-prefix", default=None, help="engine warm_prefix ('chat': behind the template's head)")
    ap.add_argument("--reader", default=None, metavar="DIR",
                    help="a reader adapter (kvboost-rag adapt) for every reuse setting; plain HF stays the base model")
    ap.add_argument("--block-adapter", default=None, metavar="DIR",
                    help="also run the 'block' setting: a second engine with this block adapter at repair='none', "
                         "checked against the independent HF block construction")
    ap.add_argument("--adapted-full", action="store_true",
                    help="with --block-adapter: also the adapted model's plain HF full prefill of the same ids, "
                         "and block reading's own cost against it (block_cost)")
    ap.add_argument("--cache-bytes", default="2GiB",
                    help="each engine's store budget (max_cache_bytes); it must hold every document of the split, "
                         "or the run stops (default 2GiB; dev2 and test2 need more, e.g. 6GiB)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (default) or cuda[:N]: every arm runs there (the reference included)")
    ap.add_argument("--final", action="store_true",
                    help="confirm reading a test split (test, test2): it is read once, by the final benchmark of an "
                         "adapter or setting chosen on dev, dev2 or heldout")
    ap.add_argument("--json", dest="json_path", help="write the result as JSON")
    ap.add_argument("--ttft-k", type=nonnegative_int, default=0,
                    help="instead of the quality run: TTFT of long chats with this many documents (28: ~4K tokens)")
    ap.add_argument("--ttft-prompts", type=positive_int, default=4, help="prompts for --ttft-k (default 4)")
    ap.add_argument("--start", type=nonnegative_int, default=0, help="first question index (to split a run)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="instead of running: merge result files of disjoint question slices")
    ap.add_argument("--plot", dest="plot_path", help="recompute share vs same answer / accuracy / speedup")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.split in rc.READ_ONCE and not args.final and not args.merge:
        ap.error(f"--split {args.split} is a test split, read once by a final benchmark; choose on dev, dev2 or "
                 "heldout, then pass --final to confirm")
    if args.adapted_full and not args.block_adapter:
        ap.error("--adapted-full needs --block-adapter (the adapted model)")
    chosen = {}
    for s in filter(None, args.settings.split(",")):  # "" runs full prefill (and --block-adapter's block) only
        if s not in SETTINGS:
            ap.error(f"--settings: unknown setting {s!r}; choose from {', '.join(SETTINGS)}")
        chosen[s] = SETTINGS[s]
    if args.merge:
        parts = []
        for f in args.merge:
            with open(f) as fh:
                parts.append(json.load(fh))
        result = merge_runs(parts)
        print_table(result)
        _save(result, args.json_path, args.plot_path)
        return 0
    from kvboost_core.config import parse_bytes
    from kvboost_rag.app.loading import load_rag

    try:
        cache_bytes = parse_bytes(args.cache_bytes)
    except (TypeError, ValueError) as exc:
        ap.error(f"--cache-bytes: {exc}")
    rag = load_rag(args.model, args.device, warm_prefix=args.warm_prefix, reader_adapter=args.reader,
                   max_cache_bytes=cache_bytes)  # --model checked first
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    block_rag = load_rag(args.model, args.device, block_adapter=args.block_adapter,
                         max_cache_bytes=cache_bytes) if args.block_adapter else None
    if args.ttft_k:
        from kvboost_rag.app.bench.rag_ttft import print_ttft, ttft_long

        result = ttft_long(rag, args.ttft_k, args.ttft_prompts, chosen, block_rag=block_rag)
        print_ttft(result)
    else:
        result = run(rag, args.split, args.k, args.questions, chosen, args.max_new_tokens, start=args.start,
                     block_rag=block_rag, adapted_full=args.adapted_full)
        print_table(result)
    _save(result, args.json_path, None if args.ttft_k else args.plot_path)
    return 0


def _save(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    write_json(json_path, result)
    if plot_path:
        plot_curve(result, plot_path)


# the chat format (rag_chat) is re-exported: multiturn, demo_chat and older scripts import it from here
__all__ = ["ADAPTED_FULL", "DEFAULT_MODEL", "SETTINGS", "SYSTEM", "Reference", "Row", "Summary", "first_sentence",
           "hf_greedy", "main", "merge_runs", "messages", "plot_curve", "print_table", "run", "summaries", "summarize",
           "user_message"]


if __name__ == "__main__":
    raise SystemExit(main())

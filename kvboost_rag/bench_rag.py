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

    python -m kvboost_rag.bench_rag --split eval --k 12 --json benchmarks/results/rag_quality.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvboost_core.adapters import output_cache
from kvboost_core.fidelity import kl_divergence

SYSTEM = "You are a helpful assistant. Answer the question using only the documents. Be brief."
DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> engine kwargs for KVBoostRAG.generate; "full" is the engine's own full recompute (must equal HF)
SETTINGS: dict[str, dict[str, Any]] = {
    "engine-full": {"repair": "full"},
    "none": {"repair": "none"},
    "cacheblend-0.15": {"repair": "cacheblend", "recompute_ratio": 0.15},
    "cacheblend-0.3": {"repair": "cacheblend", "recompute_ratio": 0.3},
    "cacheblend-0.5": {"repair": "cacheblend", "recompute_ratio": 0.5},
    "default": {},
}


def user_message(question: str, docs: Sequence[str]) -> str:
    body = "\n\n".join(docs)
    return f"Documents:\n\n{body}\n\nQuestion: {question}"


def messages(question: str, docs: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(question, docs)}]


def first_sentence(text: str) -> str:
    """Normalized first sentence: lower case, single spaces, no trailing punctuation."""
    t = " ".join(text.strip().split()).lower()
    m = re.search(r"(?<![0-9])[.!?](\s|$)|\n", t)
    t = t[: m.start()] if m else t
    return t.strip(" .!?,;:\"'")


@dataclass(slots=True)
class Reference:
    ids: list[int]
    logits: torch.Tensor  # (vocab,) fp32, first generated token
    tokens: list[int]
    text: str
    ttft_s: float


@torch.inference_mode()
def hf_greedy(model: Any, tokenizer: Any, ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> Reference:
    """Plain HF: a full prefill of ``ids`` (logits of the last position only), then greedy steps on HF's cache."""
    t0 = time.perf_counter()
    x = torch.tensor([list(ids)], device=model.device)
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1].float()
    ttft = time.perf_counter() - t0
    cache, tokens = output_cache(out), []
    nxt = int(logits.argmax())
    while True:
        tokens.append(nxt)
        if nxt in eos or len(tokens) >= max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[nxt]], device=model.device), cache=cache, use_cache=True)
        cache = output_cache(out)
        nxt = int(out.logits[0, -1].argmax())
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


def summarize(setting: str, rows: Sequence[Row], full_ttft: float) -> Summary:
    n = len(rows)
    ttft = statistics.median(r.ttft_s for r in rows)
    return Summary(setting, n, sum(r.correct for r in rows) / n, sum(r.same_answer for r in rows) / n,
                   sum(r.greedy_match for r in rows) / n, statistics.fmean(r.kl for r in rows),
                   sum(r.top1 for r in rows) / n, statistics.fmean(r.reuse for r in rows),
                   statistics.fmean(r.recompute for r in rows), ttft, full_ttft / ttft)


def run(rag: Any, split: str, k: int, n_questions: int | None, settings: dict[str, dict[str, Any]],
        max_new_tokens: int = 32, seed: int = 0, log: Any = print, start: int = 0) -> dict[str, Any]:
    from kvboost_rag import rag_corpus as rc

    corpus = rc.load_corpus(split)
    sets = rc.retrieval_sets(corpus, k, seed)[start:][: n_questions or None]
    engine = rag.engine
    t0 = time.perf_counter()
    rag.warm_documents([rc.doc_text(d) for d in corpus.documents], progress=False)
    warm_s = time.perf_counter() - t0
    eos = set(engine._eos)
    rows: dict[str, list[Row]] = {"full": []}
    for s in settings:
        rows[s] = []
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
        for name, kw in settings.items():
            res = rag.generate(prompt, max_new_tokens=max_new_tokens, add_special_tokens=special,
                               store_prefix=False, **kw)
            if res.prompt_token_ids != ids:
                raise RuntimeError(f"prompt drift in setting {name}: the transparent path changed the ids")
            assert res.first_logits is not None
            first_kl = kl_divergence(ref.logits, res.first_logits)
            top1 = int(res.first_logits.argmax()) == int(ref.logits.argmax())
            st = res.stats
            n = st["prompt_tokens"]
            rows[name].append(Row(
                q.question, q.answer, name, res.text, rc.is_correct(res.text, q),
                first_sentence(res.text) == ref_sentence, list(res.token_ids) == ref.tokens, first_kl, top1,
                (st["reused_exact"] + st["reused_approx"]) / n, st["recomputed"] / n, st["ttft_s"]))
        if log:
            log(f"[{i + 1}/{len(sets)}] {len(ids)} tok  gold={q.answer!r}  full={ref.text[:70]!r}")
            for s in settings:
                r = rows[s][-1]
                log(f"    {s:<20} {'=' if r.same_answer else 'x'}{'+' if r.correct else '-'} {r.answer[:70]!r}")
    full_ttft = statistics.median(r.ttft_s for r in rows["full"])
    summaries = {s: asdict(summarize(s, r, full_ttft)) for s, r in rows.items()}
    return {"split": split, "k": k, "questions": len(sets), "max_new_tokens": max_new_tokens, "seed": seed,
            "prompt_tokens_median": statistics.median(prompt_tokens), "warm_s": warm_s,
            "engine": {"recompute_ratio": engine.config.recompute_ratio, "check_layer": engine.config.check_layer,
                       "select": engine.config.select, "repair": engine.config.repair},
            "settings": {s: kw for s, kw in settings.items()}, "summary": summaries,
            "rows": {s: [asdict(x) for x in r] for s, r in rows.items()}}


def print_table(result: dict[str, Any]) -> None:
    print(f"split={result['split']} k={result['k']} questions={result['questions']} "
          f"prompt tokens (median)={result['prompt_tokens_median']}")
    print(f"{'setting':<22}{'acc':>7}{'same':>7}{'greedy':>8}{'KL':>8}{'top1':>7}{'reuse':>7}{'recomp':>8}"
          f"{'TTFT s':>8}  speed")
    for s, m in result["summary"].items():
        print(f"{s:<22}{m['accuracy']:>7.1%}{m['same_answer']:>7.1%}{m['greedy_match']:>8.1%}{m['kl_mean']:>8.4f}"
              f"{m['top1']:>7.1%}{m['reuse']:>7.1%}{m['recompute']:>8.1%}{m['ttft_s']:>8.3f}  "
              f"{m['speedup']:.2f}x faster")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvboost-rag bench rag", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name, a local HF folder or a hub id")
    ap.add_argument("--split", choices=("tune", "eval"), default="eval", help="tune: for tuning; eval: held out")
    ap.add_argument("--k", type=int, default=12, help="retrieved documents per question (gold included)")
    ap.add_argument("--questions", type=int, default=None, help="first N questions (default: all)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = {}
    for s in args.settings.split(","):
        if s not in SETTINGS:
            ap.error(f"--settings: unknown setting {s!r}; choose from {', '.join(SETTINGS)}")
        chosen[s] = SETTINGS[s]
    from kvboost_rag import KVBoostRAG

    rag = KVBoostRAG.from_model_id(args.model, device="cpu")
    result = run(rag, args.split, args.k, args.questions, chosen, args.max_new_tokens)
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fidelity of a weight precision (issue #35, item 5): the same RAG prompts through plain HF on the fp32 model
(the reference) and on the same model held at ``--weights`` (:mod:`kvboost_core.model.weights`), side by side.

Per question (``--split``, ``k`` documents, ``apply_chat_template``'s ids): each model's full prefill and greedy
answer (up to ``--max-new-tokens``, stopping at EOS). Reported: RAG accuracy of both with the paired bootstrap
95% interval of the difference and McNemar's p; the share of answers equal token for token and by first sentence;
first-token agreement and KL(reference || precision) of the first-token distribution.

    OMP_NUM_THREADS=1 python benchmarks/bench_precision.py --split heldout --weights fp16 \\
        --json benchmarks/results/precision_fp16.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvboost_rag.app.bench import write_json
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, first_sentence, messages


def eos_ids(model: Any, tok: Any) -> set[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids: where a greedy answer stops."""
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    return {int(tok.eos_token_id)} | set([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])


def agreement(ref: Any, low: Any) -> dict[str, Any]:
    """How one prompt's greedy answer (``hf_greedy``'s result) under another precision agrees with the fp32
    reference's: equal token for token, by first sentence, by first token, and KL(reference || other) of the
    first-token distribution."""
    import torch.nn.functional as F

    kl = F.kl_div(F.log_softmax(low.logits, -1), F.log_softmax(ref.logits, -1), log_target=True, reduction="sum")
    return {"same_answer": low.tokens == ref.tokens,
            "same_first_sentence": first_sentence(low.text) == first_sentence(ref.text),
            "same_first_token": low.tokens[:1] == ref.tokens[:1], "first_token_kl": float(kl)}


def compare(model: str, weights: str, split: str, k: int, max_new: int, limit: int | None,
            seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_core import zoo
    from kvboost_core.model.weights import pack
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.rag import hf_greedy
    from kvboost_rag.app.bench.stats import paired_accuracy

    path = zoo.resolve(model) if zoo.is_zoo_name(model) else model
    tok = AutoTokenizer.from_pretrained(path)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    low_model = pack(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), weights)
    eos = eos_ids(ref_model, tok)
    corpus = rc.load_corpus(split)
    sets = rc.retrieval_sets(corpus, k, seed)
    if limit is not None:
        sets = sets[:limit]
    rows: list[dict[str, Any]] = []
    t0 = time.process_time()
    for q, docs in sets:
        msgs = messages(q.question, [rc.doc_text(d) for d in docs])
        ids: list[int] = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,  # type: ignore[assignment]
                                                 return_dict=False)
        ref = hf_greedy(ref_model, tok, ids, max_new, eos)
        low = hf_greedy(low_model, tok, ids, max_new, eos)
        rows.append({"id": q.id, "tokens": len(ids), "ref_right": rc.is_correct(ref.text, q),
                     "low_right": rc.is_correct(low.text, q), **agreement(ref, low)})
    pa = paired_accuracy([r["ref_right"] for r in rows], [r["low_right"] for r in rows])
    return {"model": model, "weights": weights, "split": split, "k": k, "questions": len(rows),
            "max_new_tokens": max_new, "prompt_tokens_median": statistics.median(r["tokens"] for r in rows),
            "reference": "plain HF full prefill + greedy, fp32 weights",
            "accuracy": {"fp32": pa.reference_accuracy, weights: pa.accuracy, "diff": pa.diff,
                         "ci": [pa.diff_lo, pa.diff_hi], "mcnemar_p": pa.mcnemar_p, "lost": pa.lost,
                         "gained": pa.gained},
            "same_answer": statistics.fmean(r["same_answer"] for r in rows),
            "same_first_sentence": statistics.fmean(r["same_first_sentence"] for r in rows),
            "same_first_token": statistics.fmean(r["same_first_token"] for r in rows),
            "first_token_kl_mean": statistics.fmean(r["first_token_kl"] for r in rows),
            "first_token_kl_max": max(r["first_token_kl"] for r in rows),
            "cpu_s": time.process_time() - t0, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    from kvboost_core.config import PRECISIONS
    from kvboost_rag.app import rag_corpus as rc

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--weights", choices=[p for p in PRECISIONS if p != "fp32"], default="fp16")
    ap.add_argument("--split", choices=[s for s in rc.SPLITS if s not in rc.READ_ONCE], default="heldout")
    ap.add_argument("--k", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="the first N questions only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = compare(args.model, args.weights, args.split, args.k, args.max_new_tokens, args.limit)
    out["command"] = "python benchmarks/bench_precision.py " + " ".join(sys.argv[1:] if argv is None else argv)
    a = out["accuracy"]
    print(f"{out['questions']} {args.split} questions, k={args.k}: fp32 {a['fp32']:.1%}, {args.weights} "
          f"{a[args.weights]:.1%}, diff {a['diff'] * 100:+.1f} [{a['ci'][0] * 100:+.1f}, {a['ci'][1] * 100:+.1f}] "
          f"points; same answer {out['same_answer']:.1%}, same first sentence {out['same_first_sentence']:.1%}, "
          f"same first token {out['same_first_token']:.1%}; first-token KL mean {out['first_token_kl_mean']:.2e}, "
          f"max {out['first_token_kl_max']:.2e}")
    write_json(args.json, out)
    return 0

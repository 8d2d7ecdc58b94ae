"""Fidelity harness: every reuse strategy measured against a full prefill of the same token ids.

``KVEngine.verify`` (and the CLI, tests and benchmarks) use :func:`verify`. For each prompt and strategy it
reports max |Δlogit| and KL(full || reuse) of the next-token distribution, first-token top-1 agreement, the
greedy continuation exact-match rate, the reuse ratio, the share of tokens recomputed, and TTFT as a ratio to
a full prefill timed side by side.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvboost_core.model.driver import output_cache
from kvboost_core.results import speedup_text
from kvboost_core.segments import Segment
from kvboost_core.stages import TuningEngine


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_ref || P) of two next-token distributions, in nats."""
    lp = torch.log_softmax(ref_logits.float(), dim=-1)
    lq = torch.log_softmax(logits.float(), dim=-1)
    return float((lp.exp() * (lp - lq)).sum())


def compare_logits(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    return {"max_abs_diff": float((ref_logits.float() - logits.float()).abs().max()),
            "kl": kl_divergence(ref_logits, logits),
            "top1_agree": float(int(torch.argmax(ref_logits)) == int(torch.argmax(logits)))}


@dataclass(frozen=True, slots=True)
class ExactPrefixRow:
    kl: float
    top1_agree: float
    ref_margin: float  # full prefill's top-1 minus top-2 logit: how near a tie the reference is
    reused_exact: int


def prefix_probe_prompts(ids: Sequence[int], n: int) -> list[list[int]]:
    """``n`` prompts of many lengths from one token stream: a prefix of ``ids`` plus a different last token."""
    if len(ids) < 10:
        raise ValueError(f"need at least 10 token ids to cut probe prompts from, got {len(ids)}")
    lengths = [8 + (i * 7) % (len(ids) - 9) for i in range(n)]
    return [list(ids[:k]) + [ids[(k * 13) % len(ids)]] for k in lengths]


def exact_prefix_rows(engine: TuningEngine, prompts: Sequence[Sequence[int]]) -> list[ExactPrefixRow]:
    """Exact-prefix reuse against full prefill: each prompt's prefix (all but its last token) is prefilled and
    stored in ``engine``'s configuration (quantized when ``kv_bits`` is set), then the whole prompt is prefilled
    on top of it and its next-token logits are compared with a full prefill of the same ids."""
    rows = []
    for ids in prompts:
        engine.prefill([Segment(token_ids=list(ids[:-1]))])  # stores the prefix
        hit = engine.prefill([Segment(token_ids=list(ids[:-1])), Segment(token_ids=list(ids[-1:]))])
        ref = engine.full_prefill_logits(hit.token_ids)
        c = compare_logits(ref, hit.last_logits)
        top2 = torch.topk(ref.float(), 2).values
        rows.append(ExactPrefixRow(c["kl"], c["top1_agree"], float(top2[0] - top2[1]), hit.stats["reused_exact"]))
    return rows


@dataclass(slots=True)
class PromptFidelity:
    prompt: int
    repair: str
    max_abs_diff: float
    kl: float
    top1_agree: float
    greedy_match: float  # share of the greedy continuation equal to the full-prefill continuation
    reuse_ratio: float
    recomputed_share: float
    ttft_ratio: float  # reuse TTFT / full-prefill TTFT
    # engines with a block adapter: the reference of repair="none" is the adapted model's own block prefill
    # (kvboost_core.lora.block_prefill); these compare the same output with the *base* model's full prefill
    base_kl: float | None = None
    base_top1_agree: float | None = None


@dataclass(slots=True)
class FidelityReport:
    rows: list[PromptFidelity] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for repair in dict.fromkeys(r.repair for r in self.rows):
            rows = [r for r in self.rows if r.repair == repair]
            out[repair] = {
                "prompts": len(rows),
                "max_abs_diff": max(r.max_abs_diff for r in rows),
                "mean_kl": statistics.fmean(r.kl for r in rows),
                "top1_agree": statistics.fmean(r.top1_agree for r in rows),
                "greedy_match": statistics.fmean(r.greedy_match for r in rows),
                "reuse_ratio": statistics.fmean(r.reuse_ratio for r in rows),
                "recomputed_share": statistics.fmean(r.recomputed_share for r in rows),
                "ttft_ratio": statistics.median(r.ttft_ratio for r in rows),
            }
            if rows[0].base_kl is not None:  # a block adapter: the same output against the base model
                out[repair]["base_mean_kl"] = statistics.fmean(r.base_kl or 0.0 for r in rows)
                out[repair]["base_top1_agree"] = statistics.fmean(r.base_top1_agree or 0.0 for r in rows)
        return out

    def to_json(self, **kw: Any) -> str:
        return json.dumps({"summary": self.summary(), "rows": [asdict(r) for r in self.rows]}, **kw)

    def table(self) -> str:
        head = (f"{'repair':<12}{'prompts':>8}{'max|Δlogit|':>13}{'mean KL':>11}{'top-1':>8}{'greedy':>8}"
                f"{'reuse':>8}{'recomp':>8}  TTFT (full/reuse)")
        lines = [head, "-" * len(head)]
        for repair, s in self.summary().items():
            lines.append(f"{repair:<12}{s['prompts']:>8}{s['max_abs_diff']:>13.3g}{s['mean_kl']:>11.4f}"
                         f"{s['top1_agree']:>8.1%}{s['greedy_match']:>8.1%}{s['reuse_ratio']:>8.1%}"
                         f"{s['recomputed_share']:>8.1%}  {speedup_text(s['ttft_ratio'])}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@torch.inference_mode()
def _greedy_reference(engine: TuningEngine, ids: Sequence[int], n: int) -> tuple[list[int], float]:
    """Full-prefill greedy continuation through HF's own forward, and the timed prefill (TTFT) of it."""
    model = engine.model
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([list(ids)], device=engine.driver.device), use_cache=True,
                logits_to_keep=1)
    tok = int(torch.argmax(out.logits[0, -1]))
    ttft = time.perf_counter() - t0
    cache = output_cache(out)
    toks = [tok]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tok]], device=engine.driver.device), cache=cache, use_cache=True)
        cache = output_cache(out)
        tok = int(torch.argmax(out.logits[0, -1]))
        toks.append(tok)
    return toks, ttft


def greedy_match(got: Sequence[int], ref: Sequence[int], eos: set[int] | frozenset[int]) -> float:
    """Share of the reference continuation matched before the first divergence. The reference (HF's greedy
    decode, which does not stop) is cut after its first EOS, as a generation is: a continuation that ended at
    the same EOS matches in full rather than counting the tokens past it as a mismatch."""
    end = next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))
    ref = list(ref[:end])
    got = list(got[: len(ref)])
    if got == ref:
        return 1.0
    first_div = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))
    return first_div / len(ref)


def verify(engine: TuningEngine, prompts: Sequence[Any], repairs: Sequence[str] = ("none", "selective", "cacheblend"),
           max_new_tokens: int = 16, **repair_kw: Any) -> FidelityReport:
    """Compare each strategy with a full prefill of the same ids. Nothing is stored as a side effect, and
    prefixes stored from earlier repaired calls are not served, so each strategy is measured on its own."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    report = FidelityReport()
    block = getattr(engine, "block", None)
    for i, prompt in enumerate(prompts):
        ids = engine.tokenize_ids(prompt)
        full_logits = engine.full_prefill_logits(ids)
        full_tokens, ref_ttft = _greedy_reference(engine, ids, max_new_tokens)
        base_logits = None
        if block is not None:
            with block.base_weights():
                base_logits = engine.full_prefill_logits(ids)
        for repair in repairs:
            ref_logits, ref_tokens = full_logits, full_tokens
            if block is not None and repair == "none":
                ref_logits, ref_tokens = _block_reference(engine, prompt, max_new_tokens)
            # reuse_repaired=False: earlier calls' repaired prefixes would make every strategy look exact
            res = engine.generate(prompt, max_new_tokens=max_new_tokens, repair=repair, store_prefix=False,
                                  reuse_repaired=False, **repair_kw)
            pre = engine.prefill(prompt, repair=repair, store_prefix=False, reuse_repaired=False, **repair_kw)
            cmp = compare_logits(ref_logits, pre.last_logits)
            s = res.stats
            total = s["prompt_tokens"]
            report.rows.append(PromptFidelity(
                prompt=i, repair=repair, max_abs_diff=cmp["max_abs_diff"], kl=cmp["kl"],
                top1_agree=cmp["top1_agree"], greedy_match=greedy_match(res.token_ids, ref_tokens, engine.eos_token_ids),
                reuse_ratio=s["reuse_ratio"], recomputed_share=s["recomputed"] / total,
                ttft_ratio=res.ttft_s / max(ref_ttft, 1e-9),
                base_kl=None if base_logits is None else kl_divergence(base_logits, pre.last_logits),
                base_top1_agree=None if base_logits is None else float(
                    int(base_logits.argmax()) == int(pre.last_logits.argmax()))))
    return report


def _block_reference(engine: TuningEngine, prompt: Any, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The adapted model's own block prefill of ``prompt`` through plain HF calls, and its greedy tokens."""
    from kvboost_core.lora.block_prefill import block_greedy, block_runs

    segs = engine.tokenize(prompt)
    ids = [t for seg in segs for t in seg.token_ids]
    logits, tokens = block_greedy(engine.model, ids, block_runs(segs, engine.config.sink_tokens),
                                  list(engine.warm_prefix_ids), max_new_tokens, set())
    return logits, tokens

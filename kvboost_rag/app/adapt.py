"""``kvboost-rag adapt``: train a reader adapter (kvboost_core.lora.reader) by distillation on RAG chats.

Each training chat is a system turn and one user turn holding k shuffled documents and a question, rendered by
the model's chat template (the benchmark's format). The teacher is the base model with a plain full prefill of
exactly those ids: its greedy answer and its next-token distributions along it. The student sees the prompt as
kvboost serves it at ``repair="none"``: the documents' KV warmed in isolation and re-placed, the exact head
before them; the tail after the last document and the answer run through the gated adapter. The loss is
KL(teacher || student) over the answer positions (teacher forcing on the teacher's answer), so the adapter is
trained to reproduce the base model's full-prefill answers, not gold answers.

Training chats come from the tune split's documents and questions, from templated synthetic documents
(``--data synth|mix``, kvboost_rag.app.synth_corpus: many more entities and phrasings than 32 hand-written
documents), or both; validation chats always come from tune. The eval split stays held out for the benchmark
(``kvboost-rag bench rag --reader DIR``). ``--repair cacheblend --recompute-ratio R`` trains on the cache that
setting serves instead of ``none``'s, so the adapter learns to correct what is left after repair.

    kvboost-rag adapt --out ~/.cache/kvboost-rag/readers/smollm2 --samples 320 --steps 600
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, messages
from kvboost_rag.app.cli_util import positive_int

if TYPE_CHECKING:  # torch loads when a command runs, so --help and argument errors come at once
    import torch


@dataclass(slots=True)
class Sample:
    ids: list[int]  # the prompt's ids (chat template)
    gate_from: int  # first position after the last re-placed document
    past_k: list[torch.Tensor]  # per layer (1, H, gate_from, D): the prompt's KV as served at repair="none"
    past_v: list[torch.Tensor]
    answer: list[int]  # the teacher's greedy answer (EOS included when it ended)
    teacher_logp: torch.Tensor  # (A, V) bf16 log-probs of the teacher at each answer position


def teacher(model: Any, ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """The base model's greedy answer after a full prefill of ``ids`` and its log-probs at each step."""
    import torch

    from kvboost_core.model.driver import output_cache

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)]), use_cache=True, logits_to_keep=1)
        cache, tokens, logps = output_cache(out), [], []
        logits = out.logits[0, -1].float()
        while True:
            logps.append(torch.log_softmax(logits, -1).to(torch.bfloat16))
            nxt = int(logits.argmax())
            tokens.append(nxt)
            if nxt in eos or len(tokens) >= max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = output_cache(out)
            logits = out.logits[0, -1].float()
        return tokens, torch.stack(logps)


def build_samples(rag: Any, corpus: Any, n: int, ks: Sequence[int], max_new_tokens: int, seed: int,
                  student: dict[str, Any] | None = None, log: Any = print) -> list[Sample]:
    """``n`` training chats from ``corpus`` (documents warmed first), cycling over k in ``ks`` and seeds. The
    student's prompt KV is what the engine serves with ``student`` (engine kwargs; default ``repair="none"``)."""
    from kvboost_rag.app import rag_corpus as rc

    student = dict(student or {"repair": "none"})
    rag.warm_documents([rc.doc_text(d) for d in corpus.documents], show_progress=False)
    engine = rag.engine
    eos = set(engine.eos_token_ids)
    pool: list[tuple[Any, list[Any]]] = []
    round_ = 0
    while len(pool) < n:
        k = ks[round_ % len(ks)]
        pool += rc.retrieval_sets(corpus, k, seed + 1000 * round_)
        round_ += 1
    random.Random(seed).shuffle(pool)
    samples: list[Sample] = []
    t0 = time.perf_counter()
    for i, (q, docs) in enumerate(pool[:n]):
        prompt = rag.chat_prompt(messages(q.question, [rc.doc_text(d) for d in docs]))
        special = rag.chat_add_special_tokens(prompt)
        plan = rag.plan(prompt, add_special_tokens=special)
        ids = [t for s in plan.segments for t in s.token_ids]
        if not plan.doc_ranges:
            continue
        gate_from = max(b for _, b in plan.doc_ranges)
        pre = engine.prefill(plan.segments, store_prefix=False, add_special_tokens=False, **student)
        if pre.token_ids != ids:
            raise RuntimeError("prompt drift: the engine's ids differ from the plan's")
        answer, logp = teacher(engine.model, ids, max_new_tokens, eos)
        past_k = [k[:, :, :gate_from].clone() for k in pre.cache.keys]
        past_v = [v[:, :, :gate_from].clone() for v in pre.cache.values]
        samples.append(Sample(ids, gate_from, past_k, past_v, answer, logp))
        if log and (i + 1) % 20 == 0:
            log(f"  teacher {i + 1}/{n}: {len(ids)} tokens, {time.perf_counter() - t0:.0f} s")
    return samples


def student_logp(model: Any, reader: Any, s: Sample, gate: bool = True) -> torch.Tensor:
    """(A, V) log-probs along the teacher's answer, reading ``s``'s served KV, the tail through the adapter
    (``gate=False``: the base model, i.e. what ``repair="none"`` serves without an adapter)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(s.past_k, s.past_v)):
        cache.update(k, v, layer)
    tail = s.ids[s.gate_from:]
    inp = torch.tensor([tail + s.answer[:-1]])
    pos = torch.arange(s.gate_from, s.gate_from + inp.shape[1]).view(1, -1)
    with reader.gated(True if gate else None):
        out = model(input_ids=inp, position_ids=pos, cache=cache, use_cache=True)
    logits = out.logits[0, len(tail) - 1:].float()  # (A, V): positions predicting the answer tokens
    return torch.log_softmax(logits, -1)


def kl_loss(teacher_logp: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over answer positions of KL(teacher || student); both (A, V) log-probs."""
    t = teacher_logp.float()
    return (t.exp() * (t - student)).sum(-1).mean()


def train(model: Any, reader: Any, samples: Sequence[Sample], steps: int, lr: float, seed: int,
          log: Any = print) -> list[float]:
    """Train ``reader`` on ``samples`` (answer-position KL, the base weights frozen) with the adapters' one
    training loop (:func:`kvboost_rag.app.trainer.train`: AdamW, cosine with 5% warm-up, clipping at 1.0, one
    chat a step in a seeded order); returns the loss of every step. ``log=None``: no messages."""
    from kvboost_rag.app.trainer import train as loop

    for p in model.parameters():
        p.requires_grad_(False)

    def loss_at(i: int) -> Any:
        return kl_loss(samples[i].teacher_logp, student_logp(model, reader, samples[i]))

    st = loop(reader.parameters(), len(samples), loss_at, steps=steps, lr=lr, seed=seed, desc="reader adapter",
              log=log or (lambda *_: None))
    return st.losses


def evaluate(model: Any, reader: Any, samples: Sequence[Sample]) -> dict[str, float]:
    """Mean answer-position KL and first-token top-1 against the teacher, without and with the adapter."""
    import torch

    out: dict[str, float] = {}
    with torch.no_grad():
        for name, gate in (("none", False), ("reader", True)):
            kls, top1 = [], []
            for s in samples:
                lp = student_logp(model, reader, s, gate)
                kls.append(float(kl_loss(s.teacher_logp, lp)))
                top1.append(int(lp[0].argmax()) == s.answer[0])
            out[f"{name}_kl"] = statistics.fmean(kls)
            out[f"{name}_top1"] = sum(top1) / len(top1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvboost-rag adapt", description=__doc__.split("\n")[0],
                                 epilog="kvboost-rag adapt --block --help: train a block adapter instead")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name or a local HF folder (the base model)")
    ap.add_argument("--out", required=True, help="directory to write reader.safetensors + reader.json into")
    ap.add_argument("--samples", type=positive_int, default=320, help="training chats (teacher runs once per chat)")
    ap.add_argument("--val", type=positive_int, default=24, help="held-apart tune chats for the loss report")
    ap.add_argument("--steps", type=positive_int, default=600, help="optimizer steps (one chat each)")
    ap.add_argument("--k", default="4,6,8,10,12", help="documents per chat, cycled (comma-separated)")
    ap.add_argument("--rank", type=positive_int, default=8, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale = alpha / rank)")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (cosine, 5%% warm-up)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=32, help="teacher answer length")
    ap.add_argument("--data", choices=("tune", "synth", "mix"), default="tune",
                    help="training chats: the hand-written tune split, templated synthetic documents "
                         "(kvboost_rag.app.synth_corpus), or half of each; validation chats always come from tune")
    ap.add_argument("--synth-docs", type=positive_int, default=240, help="synthetic documents to write (--data synth/mix)")
    ap.add_argument("--repair", choices=("none", "cacheblend"), default="none",
                    help="the served setting whose KV the student reads (train on the setting you will serve)")
    ap.add_argument("--recompute-ratio", type=float, default=0.15, help="CacheBlend's ratio with --repair cacheblend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    try:
        ks = [int(x) for x in args.k.split(",")]
    except ValueError:
        ap.error(f"--k must be comma-separated ints, got {args.k!r}")
    if not ks or min(ks) < 1:
        ap.error(f"--k values must be >= 1, got {args.k!r}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a number > 0, got {args.lr!r}")
    if not 0.0 <= args.recompute_ratio <= 1.0:
        ap.error(f"--recompute-ratio must be in [0, 1], got {args.recompute_ratio!r}")
    from kvboost_rag.app.loading import load_rag

    t0 = time.perf_counter()
    rag = load_rag(args.model, auto_calibrate=False)  # a --model that cannot load: one line, checked first
    import torch

    from kvboost_core.lora.reader import ReaderAdapter
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.synth_corpus import synthetic_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # here, so the adapter's initial weights do not depend on how the model loaded
    engine = rag.engine
    reader = ReaderAdapter.attach(engine.model, rank=args.rank, alpha=args.alpha,
                                  base_fingerprint=engine.fingerprint)
    student: dict[str, Any] = {"repair": args.repair}
    if args.repair == "cacheblend":
        student["recompute_ratio"] = args.recompute_ratio
    tune = rc.load_corpus("tune")
    n_synth = 0 if args.data == "tune" else args.samples if args.data == "synth" else args.samples // 2
    print(f"teacher answers for {args.val} validation + {args.samples - n_synth} tune + {n_synth} synthetic chats "
          f"(k in {ks}; student reads {student})")
    samples = build_samples(rag, tune, args.samples - n_synth + args.val, ks, args.max_new_tokens, args.seed, student)
    val, trn = samples[: args.val], samples[args.val:]
    if n_synth:
        synth = synthetic_corpus(args.synth_docs, args.seed)
        trn += build_samples(rag, synth, n_synth, ks, args.max_new_tokens, args.seed, student)
    t_data = time.perf_counter() - t0
    before = evaluate(engine.model, reader, val)
    print(f"before: {before}")
    losses = train(engine.model, reader, trn, args.steps, args.lr, args.seed)
    after = evaluate(engine.model, reader, val)
    print(f"after: {after}")
    reader.meta.trained = {"base": args.model, "data": args.data, "synth_docs": args.synth_docs if n_synth else 0,
                           "student": student, "samples": len(trn), "val": len(val),
                           "steps": args.steps, "k": ks, "lr": args.lr, "max_new_tokens": args.max_new_tokens,
                           "data_s": round(t_data, 1), "train_s": round(time.perf_counter() - t0 - t_data, 1),
                           "val_answer_kl_none": after["none_kl"], "val_answer_kl_reader": after["reader_kl"],
                           "val_top1_none": after["none_top1"], "val_top1_reader": after["reader_top1"],
                           "final_loss_25": statistics.fmean(losses[-25:])}
    reader.save(args.out)
    print(json.dumps(reader.meta.trained, indent=1))
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

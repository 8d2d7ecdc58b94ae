"""``kvboost-rag adapt --block``: train a block adapter (kvboost_core.block_adapter) by distillation.

The training forward is the serving forward: :func:`kvboost_core.block_prefill.block_forward` encodes each
document on its own behind the engine's warm lead-in, re-rotates its keys to where the engine places it, and
computes the head, separators, question and answer in one causal pass over all of it, with LoRA on every
projection of every token (documents included). Gradients flow through the documents' encodings.

The teacher is the base model's plain full prefill of exactly the same ids: its greedy answer (teacher forcing)
and its next-token distributions along it. The loss is KL(teacher || student) over the answer positions, so the
adapted model is trained to give the base model's full-attention answers while reading documents as blocks.
Under this loss a full-attention adapter (the control the issue asks for) starts at zero loss and has nothing
to learn: any accuracy it could gain over the base model would come from data, and this loss has none to give.

Training chats (never the ``eval`` or ``heldout`` splits): the tune split's documents with its first 48
questions, templated synthetic documents, and varied shapes: k from 2 to 16, documents cut to varied lengths,
questions about one or two documents, some with an earlier turn in the history. Validation chats use the tune
split's last 16 questions. Data and training write checkpoints into ``--out`` and resume from them.

    kvboost-rag adapt --block --out DIR --samples 320 --steps 480 --rank 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvboost_rag.app.adapt import kl_loss, teacher
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, SYSTEM, user_message
from kvboost_rag.app.block_reference import block_plan
from kvboost_rag.app.cli_util import positive_int

if TYPE_CHECKING:  # torch loads when a command runs, so --help and argument errors come at once
    import torch

TUNE_TRAIN_QUESTIONS = 48  # tune questions [0, 48) train, [48, 64) validate
KS = (2, 3, 4, 4, 5, 6, 6, 8, 8, 10, 12, 16)  # documents per chat, drawn uniformly from this list


@dataclass(slots=True)
class Chat:
    messages: list[dict[str, str]]
    docs: list[str]


def _cut(text: str, rng: random.Random) -> str:
    """Half the documents keep all sentences; the rest keep a random leading share (at least two)."""
    if rng.random() < 0.5:
        return text
    sents = [s for s in text.replace("\n", "\n ").split(". ") if s]
    keep = max(2, int(len(sents) * rng.uniform(0.4, 0.9)))
    return ". ".join(sents[:keep]).rstrip(".") + "."


def make_chats(corpus: Any, questions: Sequence[Any], n: int, seed: int) -> list[Chat]:
    """``n`` varied RAG chats over ``corpus``'s documents, asking ``questions`` (each names its gold doc)."""
    from kvboost_rag.app import rag_corpus as rc

    rng = random.Random(seed)
    by_id = {d.id: d for d in corpus.documents}
    chats: list[Chat] = []
    for _ in range(n):
        k = min(rng.choice(KS), len(corpus.documents))
        q1 = rng.choice(questions)
        asked = [q1]
        if rng.random() < 0.25:  # a second question, about another document
            asked.append(rng.choice([q for q in questions if q.doc_id != q1.doc_id]))
        gold = list(dict.fromkeys(q.doc_id for q in asked))
        others = [d.id for d in corpus.documents if d.id not in gold]
        ids = gold + rng.sample(others, max(0, k - len(gold)))
        rng.shuffle(ids)
        docs = [_cut(rc.doc_text(by_id[i]), rng) for i in ids]
        msgs = [{"role": "system", "content": SYSTEM}]
        if rng.random() < 0.2:  # an earlier turn: the documents came with it, the new question follows
            first = rng.choice([q for q in questions if q.doc_id in ids])
            msgs += [{"role": "user", "content": user_message(first.question, docs)},
                     {"role": "assistant", "content": f"{first.answer}."}]
            question = " ".join(q.question for q in asked)
            msgs.append({"role": "user", "content": f"Question: {question}"})
        else:
            question = " ".join(q.question for q in asked)
            msgs.append({"role": "user", "content": user_message(question, docs)})
        chats.append(Chat(msgs, docs))
    return chats


@dataclass(slots=True)
class Sample:
    ids: list[int]  # the prompt's ids, as the engine sees them
    runs: list[Any]  # block_prefill.Run: which positions come from which isolated document
    answer: list[int]  # the teacher's greedy answer (EOS included when it ended)
    teacher_logp: torch.Tensor  # (A, V) bf16 log-probs of the base model's full prefill along the answer


def prepare(rag: Any, chat: Chat, max_new_tokens: int, teacher_model: Any) -> Sample | None:
    """The engine's own plan of ``chat`` (its documents registered here) and the base model's answer to it;
    None when the planner finds no document in it."""
    register(rag, chat.docs)
    prompt = rag.chat_prompt(chat.messages)
    plan = block_plan(rag, prompt, rag.chat_add_special_tokens(prompt))
    if not plan.documents:
        return None
    answer, logp = teacher(teacher_model, plan.ids, max_new_tokens, set(rag.engine.eos_token_ids))
    return Sample(plan.ids, plan.runs, answer, logp)


def register(rag: Any, texts: Sequence[str]) -> None:
    """Make ``texts`` known to the planner as documents without computing their KV (training encodes them
    itself): the registry entry :func:`kvboost_rag.warming.warm_documents` would write, with the engine's ids."""
    from kvboost_rag.warming import _register

    for text in dict.fromkeys(texts):
        if rag.registry.by_text(text) is None:
            _register(rag.registry, rag._encode_doc, text, rag.engine.encode(text))


def student_logp(model: Any, lead: Sequence[int], s: Sample) -> torch.Tensor:
    """(A, V) log-probs along the teacher's answer under block attention (the serving forward)."""
    import torch

    from kvboost_core.block_prefill import block_forward

    logits, _ = block_forward(model, s.ids + s.answer[:-1], s.runs, lead, logits_from=len(s.ids) - 1)
    return torch.log_softmax(logits, -1)


def evaluate(model: Any, lora: Any, lead: Sequence[int], samples: Sequence[Sample]) -> dict[str, float]:
    """Answer-position KL and first-token top-1 against the teacher: block attention without and with LoRA."""
    import torch

    out: dict[str, float] = {}
    for name, gate in (("base", None), ("block", True)):
        kls, top1 = [], []
        with torch.no_grad(), lora.gated(gate):
            for s in samples:
                lp = student_logp(model, lead, s)
                kls.append(float(kl_loss(s.teacher_logp, lp)))
                top1.append(int(lp[0].argmax()) == s.answer[0])
        out[f"{name}_kl"] = statistics.fmean(kls)
        out[f"{name}_top1"] = sum(top1) / len(top1)
    return out


def train(model: Any, lora: Any, lead: Sequence[int], samples: Sequence[Sample], steps: int, lr: float,
          seed: int, ckpt: str | None = None, every: int = 20, log: Any = print) -> list[float]:
    """AdamW on the LoRA weights, cosine schedule with 5% warm-up; resumes from and writes ``ckpt``."""
    import torch
    from tqdm import tqdm

    for p in model.parameters():
        p.requires_grad_(False)
    params = lora.parameters()
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses: list[float] = []
    start = 0
    if ckpt and os.path.isfile(ckpt):
        state = torch.load(ckpt, weights_only=False)
        lora.load_state_dict(state["lora"])
        opt.load_state_dict(state["opt"])
        start, losses = int(state["step"]), list(state["losses"])
        log(f"resuming at step {start}/{steps}")
    order = list(range(len(samples))) * (steps // max(1, len(samples)) + 1)
    random.Random(seed).shuffle(order)
    warmup = max(1, steps // 20)
    bar = tqdm(range(start, steps), desc="block adapter", initial=start, total=steps, mininterval=10)
    with lora.gated(True):
        for step in bar:
            scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            s = samples[order[step]]
            loss = kl_loss(s.teacher_logp, student_logp(model, lead, s))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{statistics.fmean(losses[-20:]):.4f}")
            if ckpt and ((step + 1) % every == 0 or step + 1 == steps):
                tmp = ckpt + ".tmp"
                torch.save({"lora": lora.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                            "losses": losses}, tmp)
                os.replace(tmp, ckpt)
    for p in params:
        p.requires_grad_(False)
    return losses


def build_data(rag: Any, chats: Sequence[Chat], max_new_tokens: int, path: str | None, log: Any = print
               ) -> list[Sample]:
    """Teacher answers for ``chats``, resumed from and checkpointed to ``path`` every 16 chats."""
    import torch
    from tqdm import tqdm

    done: list[Sample] = []
    if path and os.path.isfile(path):
        done = [Sample(**d) for d in torch.load(path, weights_only=False)]
        log(f"resuming data at {len(done)}/{len(chats)} chats")
    model = rag.engine.model
    for i in tqdm(range(len(done), len(chats)), desc="teacher answers", initial=len(done), total=len(chats),
                  mininterval=10):
        s = prepare(rag, chats[i], max_new_tokens, model)
        if s is None:
            raise RuntimeError(f"chat {i} has no document the engine recognises: were its documents warmed?")
        done.append(s)
        if path and ((i + 1) % 16 == 0 or i + 1 == len(chats)):
            torch.save([{f: getattr(x, f) for f in Sample.__slots__} for x in done], path + ".tmp")
            os.replace(path + ".tmp", path)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvboost-rag adapt --block", description=__doc__.split("\n")[0])
    ap.add_argument("--block", action="store_true", help="(selects this trainer)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name or a local HF folder (the base model)")
    ap.add_argument("--out", required=True, help="directory for block.safetensors + block.json and checkpoints")
    ap.add_argument("--samples", type=positive_int, default=320, help="training chats (the teacher runs once each)")
    ap.add_argument("--synth-share", type=float, default=0.5, help="share of training chats on synthetic documents")
    ap.add_argument("--synth-docs", type=positive_int, default=240, help="synthetic documents to write")
    ap.add_argument("--val", type=positive_int, default=16, help="validation chats (tune questions 48-63)")
    ap.add_argument("--steps", type=positive_int, default=480, help="optimizer steps (one chat each)")
    ap.add_argument("--rank", type=positive_int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (scale = alpha / rank)")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    ap.add_argument("--max-new-tokens", type=positive_int, default=24, help="teacher answer length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a number > 0, got {args.lr!r}")
    if not 0.0 <= args.synth_share <= 1.0:
        ap.error(f"--synth-share must be in [0, 1], got {args.synth_share!r}")
    from kvboost_rag.app.loading import load_rag

    t0 = time.perf_counter()
    rag = load_rag(args.model, auto_calibrate=False, repair="none")  # an unloadable --model: one line, first
    import torch

    from kvboost_core.block_adapter import TARGETS, BlockMeta, save
    from kvboost_core.reader import ReaderAdapter
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.synth_corpus import synthetic_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # here, so the adapter's initial weights do not depend on how the model loaded
    os.makedirs(args.out, exist_ok=True)
    engine = rag.engine
    lead = list(engine.warm_prefix_ids)
    tune = rc.load_corpus("tune")
    synth = synthetic_corpus(args.synth_docs, args.seed)
    n_synth = round(args.samples * args.synth_share)
    chats = (make_chats(tune, tune.questions[:TUNE_TRAIN_QUESTIONS], args.samples - n_synth, args.seed)
             + make_chats(synth, synth.questions, n_synth, args.seed + 1))
    val_chats = make_chats(tune, tune.questions[TUNE_TRAIN_QUESTIONS:], args.val, args.seed + 2)
    samples = build_data(rag, chats, args.max_new_tokens, os.path.join(args.out, "data.pt"))
    val = build_data(rag, val_chats, args.max_new_tokens, os.path.join(args.out, "val.pt"))
    t_data = time.perf_counter() - t0
    lora = ReaderAdapter.attach(engine.model, rank=args.rank, alpha=args.alpha, base_fingerprint=engine.fingerprint)
    t1 = time.perf_counter()
    losses = train(engine.model, lora, lead, samples, args.steps, args.lr, args.seed,
                   ckpt=os.path.join(args.out, "train.pt"))
    t_train = time.perf_counter() - t1
    after = evaluate(engine.model, lora, lead, val)
    print(f"validation: {after}")
    tokens = [len(s.ids) for s in samples]
    meta = BlockMeta(args.rank, args.alpha, TARGETS, str(engine.fingerprint), tuple(lead), engine.config.sink_tokens,
                     trained={"base": args.model, "samples": len(samples), "synth_share": args.synth_share,
                              "val": len(val), "steps": args.steps, "rank": args.rank, "alpha": args.alpha,
                              "lr": args.lr, "max_new_tokens": args.max_new_tokens, "ks": list(KS),
                              "prompt_tokens_median": statistics.median(tokens), "data_s": round(t_data, 1),
                              "train_s": round(t_train, 1), "threads": torch.get_num_threads(),
                              "val_kl_base": after["base_kl"], "val_kl_block": after["block_kl"],
                              "val_top1_base": after["base_top1"], "val_top1_block": after["block_top1"],
                              "final_loss_20": statistics.fmean(losses[-20:]), "loss_curve": losses[::10]})
    fp = save(args.out, lora.state_dict(), meta)
    size = os.path.getsize(os.path.join(args.out, "block.safetensors"))
    print(json.dumps({k: v for k, v in meta.trained.items() if k != "loss_curve"}, indent=1))
    print(f"saved to {args.out} ({size / 1e6:.1f} MB, fingerprint {fp[:16]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvboost-rag adapt --block``: train a block adapter (kvboost_core.lora.block_adapter) by distillation.

The training forward is the serving forward: :func:`kvboost_core.lora.block_prefill.block_hidden` encodes each
document on its own behind the engine's warm lead-in, re-rotates its keys to where the engine places it, and
computes the head, separators, question and answer in one causal pass over all of it, with LoRA on every
projection of every token (documents included). Gradients flow through the documents' encodings.

The teacher is the base model's plain full prefill of exactly the same ids (:mod:`.distill`): its greedy answer
and, at every tail row, its sparse next-token distribution and final hidden state, computed once into
``--data`` and shared by every run that names the same directory. Recipes (``--recipe``, :data:`distill.RECIPES`):

- ``a``: KL on the answer rows (the recipe of the shipped adapter);
- ``b``: dense distillation: KL at every question and answer row, plus the teacher's hidden states there;
- ``c``: ``b`` plus cross-entropy on the gold answer where a chat has one;
- ``d``: ``b`` with 4 link slots after each document (:mod:`kvboost_core.lora.block_links`; not served yet);
- ``e``: ``b``, plus the same loss for the adapted model's own full-attention prefill of the ids (it keeps the base
  model's behaviour under full attention while it learns block reading).

Training chats (:mod:`.train_corpus`): real English prose (standard-library docstrings, installed distributions'
descriptions) and invented-entity documents, in five question kinds, some with an earlier turn. Never the
hand-written splits. The dev split (``--eval``, k=12) is for every choice; the test split is never read here.
A run stops at ``--steps`` or ``--cpu-minutes`` (the budget curve's x axis), checkpoints into ``--out`` and
resumes from it; ``--eval`` scores the dev split at the end: accuracy of the adapted model under block attention
against the base model's full prefill, with a paired bootstrap CI.

    kvboost-rag adapt --block --data ~/kvb/data --out ~/kvb/b --recipe b --chats 1200 --cpu-minutes 30 --eval
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, messages
from kvboost_rag.app.block_reference import block_plan
from kvboost_rag.app.cli_util import positive_int

DEV_K = 12


def register(rag: Any, texts: Sequence[str]) -> None:
    """Make ``texts`` known to the planner as documents without computing their KV (training encodes them
    itself): the registry entry :func:`kvboost_rag.warming.warm_documents` would write, with the engine's ids."""
    from kvboost_rag.warming import _register

    for text in dict.fromkeys(texts):
        if rag.registry.by_text(text) is None:
            _register(rag.registry, rag._encode_doc, text, rag.engine.encode(text))


def chat_target(rag: Any, msgs: Sequence[dict[str, str]], docs: Sequence[str], max_new_tokens: int,
                kind: str = "", gold: str | None = None) -> Any:
    """The engine's own plan of a chat (its documents registered here) and the base model's teacher target for
    it (:func:`.distill.teacher_target`); None when the planner finds no document in it."""
    from kvboost_rag.app.distill import tail_start, teacher_target

    register(rag, docs)
    prompt = rag.chat_prompt(list(msgs))
    plan = block_plan(rag, prompt, rag.chat_add_special_tokens(prompt))
    if not plan.documents or not 0 < tail_start(plan.runs) < len(plan.ids):
        return None
    eos = set(rag.engine.eos_token_ids)
    gold_ids = None
    if gold:
        gold_ids = rag.engine.encode(gold) + sorted(eos)[:1]
    return teacher_target(rag.engine.model, plan.ids, plan.runs, max_new_tokens, eos, kind=kind, gold=gold_ids)


def dev_targets(rag: Any, root: str, max_new_tokens: int, split: str = "dev", limit: int | None = None) -> list[Any]:
    """Teacher targets of ``split``'s questions at k=12 (retrieval_sets seed 0), cached under ``root``."""
    from kvboost_rag.app import distill
    from kvboost_rag.app import rag_corpus as rc

    if split in rc.READ_ONCE:
        raise ValueError(f"the {split} split is read once, by the final benchmark, never by the trainer")
    corpus = rc.load_corpus(split)
    sets = rc.retrieval_sets(corpus, DEV_K, 0)
    if limit is not None and limit < len(sets):  # an even spread over the split's documents and kinds
        sets = sets[:: len(sets) // limit][:limit]
        root = f"{root}-{limit}"  # shards hold chats by index: another selection must not read them

    def make(i: int) -> Any:
        q, docs = sets[i]
        texts = [rc.doc_text(d) for d in docs]
        return chat_target(rag, messages(q.question, texts), texts, max_new_tokens, kind=q.id)

    targets = distill.build_targets(root, len(sets), make)
    wanted = [q.id for q, _ in sets]
    got = [t.kind for t in targets]
    if not set(got) <= set(wanted) or len(got) != len(set(got)):
        raise RuntimeError(f"{root} holds targets of another selection of {split!r} questions; delete it or "
                           "point --data elsewhere")
    return targets


def evaluate(rag: Any, lora: Any, lead: Sequence[int], targets: Sequence[Any], max_new_tokens: int,
             split: str = "dev", gates: Sequence[bool | None] = (True,), links: Any = None,
             full: bool = False) -> dict[str, Any]:
    """Accuracy of the base model's full prefill (the teacher's answers) and, per gate, of the model under block
    attention (``None``: base weights; ``True``: the adapter), with paired bootstrap CIs; answer-row KL.
    ``links``: a link table's rows (the prompts get that many link slots after every document). ``full``: also
    each gate's own full prefill of the same ids (no link slots), and block attention's accuracy against it
    (``block_cost``: the cost of block reading itself, apart from what the weights changed; ``full_answer_kl``:
    the answer-row KL of that full prefill against the base model's, how far the weights moved it)."""
    import torch

    from kvboost_core.lora.block_prefill import block_greedy
    from kvboost_rag.app import distill
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.rag import hf_steps
    from kvboost_rag.app.bench.stats import paired_accuracy

    corpus = rc.load_corpus(split)
    qs = {q.id: q for q in corpus.questions}
    tok, eos = rag.engine.tokenizer, set(rag.engine.eos_token_ids)
    model = rag.engine.model

    def text(ids: Sequence[int]) -> str:
        return str(tok.decode([t for t in ids if t not in eos], skip_special_tokens=True))

    ref = [rc.is_correct(text(t.answer), qs[t.kind]) for t in targets]
    out: dict[str, Any] = {"split": split, "k": DEV_K, "questions": len(targets), "full_acc": statistics.fmean(ref)}
    for gate in gates:
        name = "adapted" if gate else "base"
        got, same, kls = [], [], []
        encoded: dict = {}
        with torch.inference_mode(), lora.gated(gate):
            n_links = 0 if links is None else int(links.shape[0])
            for t in targets:
                ids, runs, _ = distill.student_view(t, [], n_links)
                _, tokens = block_greedy(model, ids, runs, lead, max_new_tokens, eos, encoded, links)
                got.append(rc.is_correct(text(tokens), qs[t.kind]))
                same.append(tokens == t.answer)
                kls.append(float(distill.student_loss(model, lead, t, distill.Recipe("answer", links=n_links),
                                                      encoded, links)))
                encoded.clear()
            # plain HF greedy of the same ids (the reference bench rag --adapted-full uses), not teacher targets;
            # and the answer-row KL of that full prefill against the base model's (how far the weights moved it)
            own, full_kls = [], []
            for t in targets if full else ():
                own.append(rc.is_correct(text(hf_steps(model, t.ids, max_new_tokens, stop=eos)[1]), qs[t.kind]))
                full_kls.append(float(distill.full_loss(model, t, distill.Recipe("answer"))))
        pa = paired_accuracy(ref, got)
        out[name] = {"acc": pa.accuracy, "diff": pa.diff, "ci": [pa.diff_lo, pa.diff_hi], "p": pa.mcnemar_p,
                     "same_answer": statistics.fmean(same), "answer_kl": statistics.fmean(kls)}
        if full:
            bc = paired_accuracy(own, got)
            out[name]["full_acc"] = bc.reference_accuracy
            out[name]["block_cost"] = {"diff": bc.diff, "ci": [bc.diff_lo, bc.diff_hi], "p": bc.mcnemar_p}
            out[name]["full_answer_kl"] = statistics.fmean(full_kls)
    return out


def nodoc_scores(rag: Any, lora: Any) -> dict[str, Any]:
    """Questions without documents, base weights vs the adapter, paired (issue #32: no regression outside RAG)."""
    from kvboost_rag.app import nodoc

    def ids(msgs: list[dict[str, str]]) -> list[int]:
        prompt = rag.chat_prompt(msgs)
        return list(rag.encode(prompt, rag.chat_add_special_tokens(prompt)))

    out = nodoc.evaluate(rag.engine.model, rag.engine.tokenizer, ids, set(rag.engine.eos_token_ids),
                         gates=(None, True), lora=lora)
    return {k: v for k, v in out.items() if k != "answers"}


def init_from(lora: Any, directory: str, base_fingerprint: str, lead: Sequence[int], rank: int, alpha: float) -> None:
    """Load a saved block adapter's LoRA weights into ``lora`` (a warm start); refuse a mismatched one."""
    import torch

    from kvboost_core.lora import block_adapter

    meta = block_adapter.read_meta(directory, base_fingerprint, lead)
    if (meta.rank, meta.alpha) != (rank, alpha):
        raise ValueError(f"--init {directory!r} has rank/alpha {meta.rank}/{meta.alpha}, this run {rank}/{alpha}")
    lora.load_state_dict({k: t.to(torch.float32) for k, t in block_adapter.read_weights(directory).items()})


def _worker(text: str) -> tuple[int, int]:
    """``W/N`` -> (W, N) with 0 <= W < N."""
    try:
        w, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W/N such as 0/4, got {text!r}") from None
    if not 0 <= w < n:
        raise argparse.ArgumentTypeError(f"expected 0 <= W < N, got {text!r}")
    return w, n


def main(argv: Sequence[str] | None = None) -> int:
    from kvboost_rag.app import distill

    ap = argparse.ArgumentParser(prog="kvboost-rag adapt --block", description=__doc__.split("\n")[0])
    ap.add_argument("--block", action="store_true", help="(selects this trainer)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name or a local HF folder (the base model)")
    ap.add_argument("--out", required=True, help="directory for block.safetensors + block.json and the checkpoint")
    ap.add_argument("--data", default=None, help="teacher-target directory, shareable across runs (default: OUT/data)")
    ap.add_argument("--recipe", choices=sorted(distill.RECIPES), default="b",
                    help="a: answer-row KL; b: dense KL + hidden states; c: b + gold answers; d: b + 4 link slots "
                    "after each document; e: b + the same loss under full attention, against drift (default: b)")
    ap.add_argument("--chats", type=positive_int, default=1200, help="training chats (the teacher runs once each)")
    ap.add_argument("--entities", type=positive_int, default=1200, help="invented-entity documents in the pool")
    ap.add_argument("--steps", type=positive_int, default=2000, help="optimizer steps (one chat each)")
    ap.add_argument("--cpu-minutes", type=float, default=None, help="stop after this much CPU time in training")
    ap.add_argument("--rank", type=positive_int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (scale = alpha / rank)")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    ap.add_argument("--max-new-tokens", type=positive_int, default=16, help="teacher answer length")
    ap.add_argument("--eval", action="store_true", help="score the dev split at the end")
    ap.add_argument("--dev-limit", type=positive_int, default=None, help="score N dev questions, spread evenly over the split")
    ap.add_argument("--data-only", action="store_true", help="compute teacher targets, then stop")
    ap.add_argument("--data-worker", type=_worker, default=(0, 1), metavar="W/N",
                    help="with --data-only: compute every N-th shard of the targets from the W-th (0-based), so N "
                    "processes fill --data side by side")
    ap.add_argument("--init", default=None, help="start from this block adapter's weights (same rank and alpha)")
    ap.add_argument("--eval-only", action="store_true", help="score --init (or the base model) on dev; no training")
    ap.add_argument("--adapted-only", action="store_true", help="with --eval-only: score the adapter only, not also "
                    "the base weights under block attention")
    ap.add_argument("--full-attention", action="store_true", help="with --eval-only: also the scored weights' own "
                    "full prefill, and block attention's accuracy against it (the cost of block reading itself)")
    ap.add_argument("--nodoc", action="store_true", help="with --eval/--eval-only: also the 64 questions without "
                    "documents, base vs adapted (kvboost_rag.app.nodoc)")
    ap.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:1 ...")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much wall time in training (this "
                    "stretch; the schedule does not follow it)")
    ap.add_argument("--wall-minutes", type=float, default=None, help="a wall-time training budget over all stretches, "
                    "which the schedule decays over (the GPU's --cpu-minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    if args.data_worker != (0, 1) and not args.data_only:
        ap.error("--data-worker needs --data-only (a worker computes a part of the targets and stops)")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a number > 0, got {args.lr!r}")
    for flag in ("cpu_minutes", "minutes", "wall_minutes"):
        value = getattr(args, flag)
        if value is not None and not (value > 0 and math.isfinite(value)):
            ap.error(f"--{flag.replace('_', '-')} must be a number > 0, got {value!r}")
    if args.init and not os.path.isfile(os.path.join(args.init, "block.json")):
        ap.error(f"--init {args.init!r} holds no block.json (a directory `kvboost-rag adapt --block` wrote)")
    init_links = False
    if args.init:  # (torch loads only now: help, argument errors and an unloadable --model come first)
        from kvboost_core.lora.block_links import LINKS_FILE

        init_links = os.path.isfile(os.path.join(args.init, LINKS_FILE))
        if init_links and not args.eval_only:  # its link table would be dropped
            ap.error(f"--init {args.init!r} has link slots ({LINKS_FILE}); starting from one is not supported yet")
    from kvboost_rag.app.loading import load_rag

    rag = load_rag(args.model, auto_calibrate=False, repair="none")  # an unloadable --model: one line, first
    import torch

    from kvboost_core.lora import block_links
    from kvboost_core.lora.block_adapter import TARGETS, BlockMeta, LoraHeader, save
    from kvboost_core.lora.reader import ReaderAdapter
    from kvboost_rag.app import train_corpus as tc
    from kvboost_rag.app.trainer import train

    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    data = args.data or os.path.join(args.out, "data")
    engine = rag.engine
    engine.model.to(args.device)  # training reads the model through plain HF calls, never the engine's forward
    lead = list(engine.warm_prefix_ids)
    c0 = time.process_time()
    pool = tc.training_pool(args.entities, args.seed)
    chats = tc.make_chats(pool, args.chats, args.seed)

    def make(i: int) -> Any:
        c = chats[i]
        return chat_target(rag, c.messages, c.docs, args.max_new_tokens, c.kind, c.gold)

    targets = [] if args.eval_only else distill.build_targets(os.path.join(data, "train"), len(chats), make,
                                                              worker=args.data_worker)
    scored = args.eval or args.eval_only
    dev = dev_targets(rag, os.path.join(data, "dev"), args.max_new_tokens, limit=args.dev_limit) if scored else []
    data_cpu = time.process_time() - c0
    if args.data_only:
        print(f"teacher targets ready under {data} ({data_cpu / 60:.1f} CPU-min this run)")
        return 0
    torch.manual_seed(args.seed)  # here, so the adapter's initial weights do not depend on how the model loaded
    lora = ReaderAdapter.attach(engine.model, rank=args.rank, alpha=args.alpha, base_fingerprint=engine.fingerprint)
    engine.model.to(args.device)  # the LoRA modules sit inside the model
    if args.init:
        init_from(lora, args.init, str(engine.fingerprint), lead, args.rank, args.alpha)
    for p in engine.model.parameters():
        p.requires_grad_(False)
    if args.eval_only:
        gates: tuple[bool | None, ...] = ((True,) if args.adapted_only else (True, None)) if args.init else (None,)
        rows = block_links.load_table(args.init, args.device) if init_links else None
        scores = evaluate(rag, lora, lead, dev, args.max_new_tokens, gates=gates, links=rows,
                          full=args.full_attention)
        scores["adapter"] = args.init
        if args.nodoc:
            scores["nodoc"] = nodoc_scores(rag, lora)
        print(json.dumps(scores, indent=1))
        with open(os.path.join(args.out, "dev_eval.json"), "w") as f:
            json.dump(scores, f, indent=1)
        return 0
    recipe = distill.RECIPES[args.recipe]
    table = None
    if recipe.links:
        table = block_links.LinkTable(engine.model, recipe.links, engine.encode("\n")[-1], args.seed).to(args.device)
    params = lora.parameters() + ([table.table] if table is not None else [])

    def weights() -> dict[str, Any]:
        return {**lora.state_dict(), **({block_links.LINKS_KEY: table.table.detach().cpu()} if table is not None else {})}

    def load_weights(tensors: dict[str, Any]) -> None:
        if table is not None:
            with torch.no_grad():
                table.table.copy_(tensors.pop(block_links.LINKS_KEY))
        lora.load_state_dict(tensors)

    def loss_at(i: int) -> Any:
        return distill.student_loss(engine.model, lead, targets[i], recipe,
                                    links=table() if table is not None else None)

    with lora.gated(True):
        st = train(params, len(targets), loss_at, steps=args.steps, lr=args.lr, seed=args.seed,
                   ckpt=os.path.join(args.out, "train.pt"), cpu_minutes=args.cpu_minutes, minutes=args.minutes,
                   wall_minutes=args.wall_minutes,
                   state_dict=weights, load_state_dict=load_weights, desc=f"block adapter ({args.recipe})")
    trained = {"base": args.model, "recipe": args.recipe, "init": args.init, "device": args.device,
               "chats": len(targets), "pool": tc.pool_hash(pool), "pool_docs": len(pool), "steps": st.step,
               "cpu_min": round(st.cpu_s / 60, 2), "wall_min": round(st.wall_s / 60, 2), "rank": args.rank,
               "alpha": args.alpha, "lr": args.lr, "max_new_tokens": args.max_new_tokens,
               "threads": torch.get_num_threads(), "prompt_tokens_median": statistics.median(len(t.ids) for t in targets),
               "final_loss_20": statistics.fmean(st.losses[-20:]), "log": st.log}

    def write(dev: dict[str, Any]) -> str:
        meta = BlockMeta(LoraHeader(args.rank, args.alpha, TARGETS, str(engine.fingerprint)), tuple(lead),
                         engine.config.sink_tokens, trained={**trained, "dev": dev})
        return save(args.out, lora.state_dict(), meta)

    fp = write({})  # saved before scoring, so a run stopped while it scores keeps its weights
    if table is not None:  # the engine cannot serve link slots yet: a separate file it refuses to load past
        block_links.save_table(args.out, table.table)
    if args.eval:
        with torch.no_grad():
            rows = table().detach() if table is not None else None
        result = evaluate(rag, lora, lead, dev, args.max_new_tokens, gates=(True,), links=rows)
        if args.nodoc:
            result["nodoc"] = nodoc_scores(rag, lora)
        print(json.dumps(result, indent=1))
        fp = write(result)
    size = os.path.getsize(os.path.join(args.out, "block.safetensors"))
    print(f"saved to {args.out} ({size / 1e6:.1f} MB, fingerprint {fp[:16]}, {st.step} steps, "
          f"{st.cpu_s / 60:.1f} CPU-min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

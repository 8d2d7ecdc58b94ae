"""Train the embedded demo model (kvboost_rag/assets/demo_model) on CPU, time-boxed and resumable.

    python scripts/train_demo_model.py --minutes 40            # data, tokenizer, training, eval, card
    python scripts/train_demo_model.py --minutes 10 --resume   # continue from the last checkpoint
    python scripts/train_demo_model.py --eval-only             # re-measure and rewrite the card

Everything is generated here (seeded): the bundled corpus and held-out questions use names reserved for
them; training streams fresh random worlds of the other names, so the model cannot memorise facts and must
copy (or combine) answers from the documents in its prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvboost_rag import demo_data as dd  # noqa: E402

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=10000.0)
ANSWER_WEIGHT = 1.0
OTHER_WEIGHT = 0.05  # document text is mostly random names (unpredictable noise): answers must dominate
FLOOR_MARGIN = 0.05
TEST_QUESTIONS = 60  # how many held-out questions tests/test_demo_model.py asks


def build_tokenizer(vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus_docs, _ = dd.make_corpus()
    text = list(dd.tokenizer_training_text(4000, seed)) + [d.text for d in corpus_docs]
    tok.train_from_iterator(text, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tok: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **MODEL_SHAPE)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def encode_sample(tok: Any, sample: dd.TrainingSample) -> tuple[list[int], list[float]]:
    """Token ids (BOS, pieces, EOS) and per-token loss weights (for the token at that position)."""
    ids = [tok.bos_token_id]
    weights = [0.0]
    for text, is_answer in sample.pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        weights += [ANSWER_WEIGHT if is_answer else OTHER_WEIGHT] * len(piece)
    ids.append(tok.eos_token_id)
    weights.append(ANSWER_WEIGHT)
    return ids, weights


def drill_sample(rng: random.Random) -> dd.TrainingSample:
    """1-3 documents, then the same documents again: a short-range, dense copying signal. Induction (copy
    what followed this token last time) is the circuit answering is built on, and a small model trained for
    minutes does not find it from the answers alone (the loss sat flat for 25 minutes of QA-only training)."""
    world = dd.make_world(rng, dd.NameSource(rng, heldout=False), 2, 2, 2)
    docs = dd.world_documents(world, rng)
    rng.shuffle(docs)
    texts = [d.text for d in docs[: rng.randint(1, 3)]]
    again = list(texts)
    rng.shuffle(again)
    head = dd.PROMPT_HEAD + dd.DOC_SEPARATOR.join(texts)
    return dd.TrainingSample(head, [(head, False), ("\nRepeat:\n\n" + dd.DOC_SEPARATOR.join(again) + "\n", True)],
                             [])


def make_batch(tok: Any, rng: random.Random, batch_size: int, drill: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    make = drill_sample if drill else dd.training_sample
    rows = [encode_sample(tok, make(rng)) for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)
    w_t = torch.zeros((batch_size, width))
    for i, (ids, w) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        w_t[i, : len(w)] = torch.tensor(w)
    return ids_t, w_t


def weighted_loss(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    mask = (weights > 0).long()
    mask[:, 0] = 1  # BOS is attended to (the sink) though it is not predicted
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="none").view(ids.shape[0], -1)
    w = weights[:, 1:]
    return (nll * w).sum() / w.sum()


def lr_at(frac: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup, then cosine decay to 10% over the time box (the schedule follows time, not steps)."""
    if frac < warmup:
        return peak * frac / warmup
    p = min(1.0, (frac - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(args: argparse.Namespace, out: Path) -> None:
    from transformers import AutoTokenizer

    ckpt = args.ckpt_dir / "demo_model.ckpt.pt"
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    if args.resume and ckpt.exists():
        tok = AutoTokenizer.from_pretrained(out)
        model = build_model(tok)
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
        opt.load_state_dict(state["opt"])
        step, elapsed0, rng_state = state["step"], state["elapsed"], state["rng"]
        budget = elapsed0 + args.minutes * 60
        phase0 = elapsed0  # the LR schedule restarts (warmup, cosine) over the resumed time box
        print(f"resumed at step {step}, {elapsed0 / 60:.1f} min trained", flush=True)
    else:
        tok = build_tokenizer(args.vocab, args.seed)
        out.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
        model = build_model(tok)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
        step, elapsed0, rng_state = 0, 0.0, None
        budget = args.minutes * 60
        phase0 = 0.0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, vocab {len(tok)}, budget {budget / 60:.1f} min", flush=True)
    rng = random.Random(args.seed + 1)
    if rng_state is not None:
        rng.setstate(rng_state)
    model.train()
    t0 = time.time() - elapsed0
    losses: list[float] = []
    last_save = time.time()
    tokens = 0
    while (elapsed := time.time() - t0) < budget:
        for g in opt.param_groups:
            g["lr"] = lr_at((elapsed - phase0) / (budget - phase0), args.lr, warmup=0.05)
        drill = rng.random() < args.drill_share
        ids, w = make_batch(tok, rng, args.batch * 2 if drill else args.batch, drill=drill)
        loss = weighted_loss(model, ids, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(ids.numel())
        losses.append(float(loss))
        if step % 25 == 0:
            print(f"step {step} t={elapsed / 60:.1f}m loss {statistics.fmean(losses[-25:]):.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} tok/s {tokens / max(elapsed - elapsed0, 1e-9):.0f}",
                  flush=True)
        if time.time() - last_save > 300:
            save(model, opt, tok, out, ckpt, step, time.time() - t0, rng, losses)
            last_save = time.time()
    save(model, opt, tok, out, ckpt, step, time.time() - t0, rng, losses)


def save(model: Any, opt: Any, tok: Any, out: Path, ckpt: Path, step: int, elapsed: float, rng: random.Random,
         losses: list[float]) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "rng": rng.getstate()}, ckpt)
    info = {"steps": step, "train_minutes": round(elapsed / 60, 1),
            "final_loss": round(statistics.fmean(losses[-100:]), 4) if losses else None}
    (ckpt.parent / "demo_model.train.json").write_text(json.dumps(info))
    print(f"saved step {step} ({elapsed / 60:.1f} min)", flush=True)


def write_data(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    docs, world = dd.make_corpus()
    dd.write_jsonl(out / dd.CORPUS_FILE, docs)
    dd.write_jsonl(out / dd.HELDOUT_FILE, dd.make_heldout(docs, world))


def evaluate(out: Path, n: int, repairs: tuple[str, ...]) -> dict[str, Any]:
    """Exact-match accuracy of greedy answers over the first ``n`` held-out questions, per repair mode, with
    the corpus warmed (so "cacheblend" re-places document KV and "full" recomputes it all)."""
    from kvboost_core.engine import KVEngine
    from kvboost_rag import KVBoostRAG

    corpus = {d["id"]: d["text"] for d in dd.load_corpus(out)}
    qs = dd.load_heldout(out)[:n]
    rag = KVBoostRAG(KVEngine.from_pretrained(str(out), device="cpu"))
    rag.warm_documents(list(corpus.values()), progress=False)
    res: dict[str, Any] = {"questions": len(qs)}
    answers: dict[str, list[str]] = {}
    for repair in repairs:
        rows = dd.evaluate(rag, qs, corpus, repair=repair)
        answers[repair] = [dd.normalize_answer(r.generated) for r in rows]
        res[repair] = {"accuracy": round(dd.accuracy(rows), 4), "single_hop": round(dd.accuracy(rows, 1), 4),
                       "two_hop": round(dd.accuracy(rows, 2), 4),
                       "mean_reuse_ratio": round(statistics.fmean(r.reuse_ratio for r in rows), 4)}
        print(repair, res[repair], flush=True)
    if "full" in answers and "cacheblend" in answers:
        # how often reuse changes the answer at all: meaningful even where the answers are wrong
        same = sum(a == b for a, b in zip(answers["full"], answers["cacheblend"], strict=True))
        res["agreement"] = round(same / len(qs), 4)
    return res


def _pct(x: float) -> str:
    return f"{x:.1%}"


def write_card(out: Path, metrics: dict[str, Any]) -> None:
    """MODEL_CARD.md from metrics.json (the figures are measured, never typed in)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(out)
    size = (out / "model.safetensors").stat().st_size
    n_params = size // 4  # fp32 weights, embeddings tied (stored once)
    train = metrics.get("training", {})
    full, blend, sub = metrics["full"], metrics["cacheblend"], metrics["test_subset"]["full"]
    docs = dd.load_corpus(out)
    qs = dd.load_heldout(out)
    status = ""
    if full["accuracy"] < 0.2:
        status = f"""
> **Status: this model does not answer the questions.** Held-out accuracy is {_pct(full["accuracy"])}
> (full prefill), about what guessing a plausible answer of the right type gives. It learned the prompt
> format and the answer types (a year for "which year", a job for "what is the job", an invented name
> otherwise) but never learned to copy from its documents (no induction) in {train.get("train_minutes", "?")}
> minutes on one shared CPU core. The accuracy floor is therefore {_pct(metrics["floor"])}, i.e. that check
> is trivial; what the test still checks meaningfully is shape, size, document reuse, and that CacheBlend
> gives the full-prefill answer on at least {_pct(metrics["agreement_floor"])} of the questions.
"""
    card = f"""# kvboost-rag embedded demo model

A small Llama-architecture model trained from scratch on CPU, meant to answer questions from retrieved
documents so that `kvboost-rag demo` and the tests can show real answers with and without KV reuse,
offline, in seconds. It knows nothing about the world: it could only copy or combine facts from its prompt.
{status}
## Architecture
- `LlamaForCausalLM`: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size},
  {cfg.num_attention_heads} attention heads / {cfg.num_key_value_heads} KV heads (GQA), head dim {cfg.head_dim},
  RoPE theta {int(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None) else 10000},
  max positions {cfg.max_position_embeddings}, tied embeddings.
- {n_params / 1e6:.2f}M parameters, fp32 safetensors of {size / 2**20:.1f} MiB.
- Tokenizer: byte-level BPE, vocabulary {cfg.vocab_size} (trained on the generated text), BOS `<s>` added in
  front, EOS `</s>`, pad `<pad>`, and a simple `<|role|>` chat template (not used in training).

## Data (all generated, seeded; `kvboost_rag/demo_data.py`)
- Invented worlds of cities (country, river), organisations (city, founding year, founder) and people (birth
  city and year, job, employer), named from random syllables. Each document states one entity's facts in
  one of two phrasings, e.g. "X is located in the city of Y. It was founded in 1873 by Z.".
- Each training sequence is a fresh random world: 3-8 of its documents in random order (the others'
  entities act as distractors), then 2-8 questions (1-6 in the first run), about a third two-hop when possible (e.g. "In which
  country was P born?" needs P's document and the city's). Format:
  `<s>Documents:\\n\\n<doc>\\n\\n<doc>...\\n\\nQuestion: ...\\nAnswer: <answer>\\n`, ending in `</s>`.
  Sequences are 105-390 tokens (median about 240). Loss on all tokens, answer tokens weighted {ANSWER_WEIGHT / OTHER_WEIGHT:.0f}x the rest (5x in the first run).
  Later runs add copy signal (see Training): documents repeated after the questions, and copy drills.
- **Held out**: a stable hash reserves 1 in {dd.HOLDOUT_MOD} possible names; training never uses them. The bundled corpus
  (`corpus.jsonl`, {len(docs)} documents: one world of 30 cities, 40 organisations, 60 people) uses only
  reserved names, and `heldout.jsonl` holds {len(qs)} questions about it (about 30% two-hop) with the gold
  `doc_ids` and a fixed `context_ids` list (gold plus distractors, 3-8 documents, shuffled).

## Training
AdamW (betas 0.9/0.95, weight decay 0.05), batch 8 (16 for copy drills), grad clip 1.0, one thread
(two threads were 5-20x slower on the shared 2-core machine). {train.get("steps", "?")} steps,
{train.get("train_minutes", "?")} min of CPU training in all; final training loss (weighted, mean of the last
100 steps) {train.get("final_loss", "?")}. It was trained in four time-boxed runs of this script, each resuming
the last (`--resume` keeps weights and optimiser state); the data mix changed between runs as the model
failed to learn in-context copying:

1. `--minutes 40 --threads 1` (stopped at 20 min): questions only, 1-6 per sequence, non-answer tokens
   weighted 0.2, peak LR 2.5e-3. It learned the format and the answer types but copied nothing
   (held-out accuracy 0-3%, loss flat from minute 5).
2. `--resume --minutes 28` (stopped after 5 min): 2-8 questions per sequence, non-answer weight 0.05. Flat.
3. `--resume --minutes 25` (stopped after 5 min): half the sequences end with the documents repeated
   ("Repeat:"), weighted as answers. Flat: a repeated name was no more predictable than a new one.
4. `--resume --minutes 22 --lr 2e-3` (the script's current defaults; stopped after 15 min): half the steps
   are copy drills (1-3 documents, then the same documents again), LR schedule restarted (warmup, cosine
   to 10%). Still no copying: on a repeated document the loss fell only from 2.59 to 2.37 nats per token.

Reproducing from scratch: `python scripts/train_demo_model.py --minutes 50 --threads 1` trains with the
current mix from the start (not what was run, so expect different figures).

## Held-out accuracy
Exact match of the greedy answer (first line, trimmed, punctuation and case normalised) on the first
{metrics["questions"]} held-out questions, prompt = the question's `context_ids` documents, corpus warmed:

| prefill | all | single-hop | two-hop | mean reuse ratio |
|---|---|---|---|---|
| full (plain full prefill) | {_pct(full["accuracy"])} | {_pct(full["single_hop"])} | {_pct(full["two_hop"])} | {_pct(full["mean_reuse_ratio"])} |
| cacheblend (default repair) | {_pct(blend["accuracy"])} | {_pct(blend["single_hop"])} | {_pct(blend["two_hop"])} | {_pct(blend["mean_reuse_ratio"])} |

On the first {metrics["test_subset"]["questions"]} questions (the subset `tests/test_demo_model.py` asks):
full prefill {_pct(sub["accuracy"])}, cacheblend {_pct(metrics["test_subset"]["cacheblend"]["accuracy"])}; cacheblend
gives the same (normalised) answer as full prefill on {_pct(metrics["test_subset"]["agreement"])} of them.

**Test floor: {_pct(metrics["floor"])}** (`metrics.json` → `floor`): the full-prefill accuracy
`tests/test_demo_model.py` requires on those questions, set {_pct(FLOOR_MARGIN)} under the lower measured figure
(clamped at 0). The test also requires full/cacheblend answer agreement of at least
{_pct(metrics["agreement_floor"])} (10 points under the measured figure).

## Limits
A toy: tiny, trained for minutes, on one narrow prompt format. It answers only questions shaped like the
training templates about documents shaped like the training documents; anything else gets noise.
Two-hop questions are much harder for it than single-hop ones. In `kvboost-rag demo` the retriever
(a hashing bag-of-words embedding) rarely finds the second document of a two-hop question, so the demo asks
single-hop questions first.
"""
    (out / "MODEL_CARD.md").write_text(card)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=dd.DEMO_MODEL_DIR)
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ckpt-dir", type=Path, default=Path("build/demo_model"),
                   help="checkpoint and training log (kept out of the package assets)")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--card-only", action="store_true", help="rewrite MODEL_CARD.md from metrics.json")
    p.add_argument("--eval-questions", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--drill-share", type=float, default=0.5, help="share of steps that are copy drills")
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--vocab", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.card_only:
        write_card(args.out, json.loads((args.out / "metrics.json").read_text()))
        return
    if not args.eval_only:
        write_data(args.out)
        train(args, args.out)
    metrics = evaluate(args.out, args.eval_questions, ("full", "cacheblend"))
    # tests/test_demo_model.py checks the first TEST_QUESTIONS questions against the floor: measure those too
    # and set the floor a few points under the lower of the two figures.
    metrics["test_subset"] = evaluate(args.out, TEST_QUESTIONS, ("full", "cacheblend"))
    low = min(metrics["full"]["accuracy"], metrics["test_subset"]["full"]["accuracy"])
    metrics["floor"] = max(0.0, math.floor((low - FLOOR_MARGIN) * 100) / 100)
    metrics["agreement_floor"] = max(0.0, math.floor((metrics["test_subset"]["agreement"] - 0.1) * 100) / 100)
    train_log = args.ckpt_dir / "demo_model.train.json"
    if train_log.exists():
        metrics["training"] = json.loads(train_log.read_text())
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_card(args.out, metrics)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()

"""Train the embedded demo model (kvboost_rag/app/assets/demo_model) on CPU, time-boxed and resumable.

How the shipped weights were made (the card lists the exact commands; they trained into build/ first):

    python scripts/train_demo_model.py --minutes 50 --no-eval     # data, tokenizer, training (2 threads)
    kvboost-rag calibrate --model kvboost_rag/app/assets/demo_model --write   # the CacheBlend setting it needs
    python scripts/train_demo_model.py --eval-only                # measure; write metrics.json and the card

    python scripts/train_demo_model.py --minutes 10 --resume      # continue from the last checkpoint
    python scripts/train_demo_model.py --device cuda --workers 6  # on a GPU, batches from 6 processes

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

from demo_model_card import write_card  # noqa: E402  (scripts/ is on sys.path when this runs as a script)

from kvboost_rag.app import demo_data as dd  # noqa: E402

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_SHAPE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=10000.0)
# Loss weight per piece kind. Answers are the signal, the restated key as much as the value (a miscopied
# subject makes the lookup fail: a run with keys at 0.5 wrote the wrong subject in most wrong answers); a
# question's entity is a copy of a document's (cheap extra copy practice); document text is mostly
# random names, i.e. unpredictable noise.
WEIGHTS = {"answer": 1.0, "key": 1.0, "question": 0.3, "context": 0.1}
FLOOR_MARGIN = 0.05
TEST_QUESTIONS = 60  # how many held-out questions tests/test_demo_model.py asks
COMMAND = " ".join(["python", "scripts/train_demo_model.py", *sys.argv[1:]])


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


def build_model(tok: Any, eager: bool = False, layers: int | None = None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**MODEL_SHAPE, **({"num_hidden_layers": layers} if layers else {})}
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **shape)
    if eager:  # copy supervision reads one head's attention probabilities (2-3x slower steps)
        cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def copyable_ids(tok: Any) -> torch.Tensor:
    """Bool over the vocabulary: entity words, years, jobs and organisation kinds (the tokens answers copy)."""
    mask = torch.zeros(len(tok), dtype=torch.bool)
    for w in [*dd.WORDS, *map(str, dd.YEARS), *dd.JOBS]:
        mask[tok(" " + w, add_special_tokens=False)["input_ids"]] = True
    return mask


def encode_samples(tok: Any, samples: list[dd.TrainingSample]) -> list[tuple[list[int], list[float]]]:
    """Per sample: token ids (BOS, pieces, EOS) and per-token loss weights (for the token at that position).

    Every piece of the batch goes to the Rust tokenizer in one call: one call per piece spent 5x longer in
    per-call overhead than in tokenizing, which starved a GPU of batches."""
    texts = [text for s in samples for text, _ in s.pieces]
    pieces = iter(e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    rows = []
    for s in samples:
        ids = [tok.bos_token_id]
        weights = [0.0]
        for _, kind in s.pieces:
            piece = next(pieces)
            ids += piece
            weights += [WEIGHTS[kind]] * len(piece)
        ids.append(tok.eos_token_id)
        weights.append(WEIGHTS["answer"])
        rows.append((ids, weights))
    return rows


# Every token kind an answer holds or a key is made of: copy heads trained on names alone did not copy years or
# jobs (a first run answered every year question with the same year) nor match keys ending in a relation word.
DRILL_VOCAB = [*dd.WORDS, *map(str, dd.YEARS), *dd.JOBS, *dd.RELATIONS]


def _copy_drill(words: list[str]) -> dd.TrainingSample:
    """The words, then the same words again; the loss is on the copy."""
    text = " " + " ".join(words)
    return dd.TrainingSample([(text, "context"), (text, "answer")])


def drill_sample(rng: random.Random) -> dd.TrainingSample:
    """A one-token copy drill: 8-40 random words, then again. Pure induction, which a fresh model here learns
    abruptly after 1,500-1,800 steps; question answering then builds on those heads (without drills the model
    sat at guessing level for 45 CPU-minutes)."""
    return _copy_drill(rng.choices(DRILL_VOCAB, k=rng.randint(8, 40)))


def pair_drill_sample(rng: random.Random) -> dd.TrainingSample:
    """A two-token copy drill: 12-40 words from a pool of about a quarter as many, then the same words again.
    Each word occurs about four times, so only the two-token context fixes the next copy: the match a fact
    lookup needs (key = subject, relation). From scratch this stayed at guessing level for 2,800 steps; on top
    of formed one-token copy heads it reached 0.77 copy accuracy in 400 steps."""
    k = rng.randint(12, 40)
    return _copy_drill(rng.choices(rng.sample(DRILL_VOCAB, max(3, k // 4)), k=k))


def make_batch(tok: Any, rng: random.Random, batch_size: int, max_docs: int = 8, drill_share: float = 0.0,
               pair_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, loss weights, answer mask): right-padded; the mask marks answer tokens for accuracy tracking.
    ``drill_share`` of the rows are copy drills, ``pair_share`` of those two-token drills."""
    samples = []
    qa_rows = torch.ones(batch_size, 1, dtype=torch.bool)  # accuracy is tracked on question answers only
    for b in range(batch_size):
        if rng.random() < drill_share:
            samples.append(pair_drill_sample(rng) if rng.random() < pair_share else drill_sample(rng))
            qa_rows[b] = drill_share >= 1.0  # drill-only batches report their copy accuracy
            continue
        samples.append(dd.training_sample(rng, min_docs=min(3, max_docs), max_docs=max_docs))
    rows = encode_samples(tok, samples)
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)
    w_t = torch.zeros((batch_size, width))
    for i, (ids, w) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        w_t[i, : len(w)] = torch.tensor(w)
    return ids_t, w_t, (w_t == WEIGHTS["answer"]) & qa_rows


class BatchStream(torch.utils.data.IterableDataset):
    """Endless training batches made in ``workers`` DataLoader processes (a GPU step outruns one Python
    process making batches). The loop steers the curriculum through shared values the workers read per batch:
    the drill share and the document cap (a prefetched batch or two lag behind, which does not matter)."""

    def __init__(self, tok: Any, seed: int, batch_size: int) -> None:
        import multiprocessing as mp

        self.tok, self.seed, self.batch_size = tok, seed, batch_size
        self.share = mp.Value("d", 1.0, lock=False)
        self.pair_share = mp.Value("d", 0.0, lock=False)
        self.max_docs = mp.Value("i", 2, lock=False)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1_000 + (info.id if info is not None else 0))
        while True:
            yield make_batch(self.tok, rng, self.batch_size, self.max_docs.value, self.share.value,
                             self.pair_share.value)


def copy_supervision(attn: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean -log(attention mass on earlier copies of the next token) over the ``targets`` positions.

    ``attn`` (B, T, T) is one head's probabilities. Where the next token to predict is an entity that already
    occurred (an answer read from a document, a drill's copy), the head is told where to look: any earlier
    occurrence of that token. A pointer this direct is learned in a few hundred steps; found only through
    the answer loss, the same lookup took longer than this CPU budget allows."""
    nxt = ids[:, 1:]  # (B, T-1): the token each position predicts
    T = ids.shape[1]
    same = ids[:, None, :] == nxt[:, :, None]  # (B, T-1, T): key j holds position p's next token
    same &= torch.ones(T - 1, T, dtype=torch.bool, device=ids.device).tril()  # causal: j <= p
    valid = targets[:, 1:] & same.any(-1)  # (B, T-1)
    if not bool(valid.any()):
        return attn.new_zeros(())
    mass = (attn[:, :-1, :] * same).sum(-1)  # (B, T-1)
    return -mass[valid].clamp_min(1e-6).log().mean()


def weighted_loss(model: Any, ids: torch.Tensor, weights: torch.Tensor, answers: torch.Tensor,
                  copyable: torch.Tensor | None = None, aux: float = 0.0) -> tuple[torch.Tensor, float]:
    """(weighted NLL + ``aux`` x copy supervision of the last layer's first head, teacher-forced accuracy on
    answer tokens)."""
    mask = (weights > 0).long()
    mask[:, 0] = 1  # BOS is attended to (the sink) though it is not predicted
    # bf16 matmuls on a GPU (fp32 master weights and loss); plain fp32 on CPU, where bf16 is ~6x slower
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
        out = model(input_ids=ids, attention_mask=mask, output_attentions=aux > 0)
    logits = out.logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="none").view(ids.shape[0], -1)
    w = weights[:, 1:]
    a = answers[:, 1:]
    acc = float((logits.argmax(-1) == ids[:, 1:])[a].float().mean()) if a.any() else float("nan")
    loss = (nll * w).sum() / w.sum()
    if aux > 0 and copyable is not None:
        # supervised positions: those predicting a copyable token with answer weight (answers, drill copies)
        # token t is a target when it is copyable and weighted as an answer; position t-1 predicts it
        targets = (weights == WEIGHTS["answer"]) & torch.nn.functional.pad(copyable[ids[:, 1:]], (1, 0))
        loss = loss + aux * copy_supervision(out.attentions[-1][:, 0].float(), ids, targets)
    return loss, acc


class Phases:
    """The curriculum's phases, each ended by accuracy rather than a step count (with a step cap):
    "drill" (one-token copy drills) until their copy accuracy over the last 50 steps reaches ``drill_until``,
    then "pair" (two-token drills) until ``pair_until``, then "qa" (question answering, drills mixed in).
    Induction forms abruptly after a variable delay, so fixed step counts either waste minutes or move on too
    early."""

    WINDOW = 50

    def __init__(self, args: argparse.Namespace, name: str = "drill", start: float = 0.0) -> None:
        self.args, self.name, self.steps = args, name, 0
        self.accs: list[float] = []
        # elapsed seconds when question answering began (a run resumed in "qa" begins it at ``start``)
        self.qa_start: float | None = start if name == "qa" else None
        self.log: list[dict[str, Any]] = []  # the transitions, for the training log and the card

    def mix(self) -> tuple[float, float]:
        """(drill share, two-token share of the drills) for the next batch."""
        if self.name == "drill":
            return 1.0, 0.0
        if self.name == "pair":
            return 1.0, 1.0
        return self.args.drill_share, 0.5

    def update(self, acc: float, step: int, elapsed: float) -> None:
        self.steps += 1
        if self.name == "qa":
            return
        self.accs.append(acc)
        recent = statistics.fmean(self.accs[-self.WINDOW:])
        until, cap, nxt = ((self.args.drill_until, self.args.drill_steps, "pair") if self.name == "drill"
                           else (self.args.pair_until, self.args.pair_drill_steps, "qa"))
        if (len(self.accs) >= self.WINDOW and recent >= until) or self.steps >= cap:
            print(f"phase {self.name} -> {nxt} at step {step}, t={elapsed / 60:.1f}m, copy acc {recent:.3f} "
                  f"over the last {self.WINDOW} steps", flush=True)
            self.log.append({"phase": self.name, "next": nxt, "step": step, "minutes": round(elapsed / 60, 1),
                             "copy_acc": round(recent, 3)})
            self.name, self.steps = nxt, 0
            self.accs.clear()
            if nxt == "qa":
                self.qa_start = elapsed


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
        model = build_model(tok, eager=args.copy_aux > 0, layers=args.layers)
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        model.to(args.device)  # before the optimizer, whose state load follows the parameters' device
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
        opt.load_state_dict(state["opt"])
        step, elapsed0, rng_state = state["step"], state["elapsed"], state["rng"]
        phases = Phases(args, state.get("phase", "qa"), start=elapsed0)
        budget = elapsed0 + args.minutes * 60
        phase0 = elapsed0  # the LR schedule restarts (warmup, cosine) over the resumed time box
        print(f"resumed at step {step}, {elapsed0 / 60:.1f} min trained", flush=True)
    else:
        if not (args.keep_tokenizer and (out / "tokenizer.json").exists()):
            # (BPE training can differ across `tokenizers` versions: --keep-tokenizer reuses the shipped one)
            tok = build_tokenizer(args.vocab, args.seed)
            out.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
        model = build_model(tok, eager=args.copy_aux > 0, layers=args.layers).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
        step, elapsed0, rng_state = 0, 0.0, None
        phases = Phases(args)
        budget = args.minutes * 60
        phase0 = 0.0
    device = torch.device(args.device)
    copyable = copyable_ids(tok).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, vocab {len(tok)}, budget {budget / 60:.1f} min, device {device}, "
          f"batch {args.batch}, batch workers {args.workers}", flush=True)
    rng = random.Random(args.seed + 1)
    if rng_state is not None:
        rng.setstate(rng_state)
    stream = None
    if args.workers > 0:  # batches from worker processes: not resumable bit for bit (each worker has its own rng)
        stream = BatchStream(tok, args.seed + 1, args.batch)
        batches = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                                   prefetch_factor=4, pin_memory=device.type == "cuda"))
    model.train()
    t0 = time.time() - elapsed0
    losses: list[float] = []
    accs: list[float] = []
    last_save = time.time()
    tokens = 0
    while (elapsed := time.time() - t0) < budget:
        for g in opt.param_groups:
            g["lr"] = lr_at((elapsed - phase0) / (budget - phase0), args.lr, warmup=0.05)
        # Curriculum: 1-2 documents first (a lookup without distractors), growing to 3-8 over the first
        # ``--curriculum`` share of the question-answering time.
        qa0 = phases.qa_start if phases.qa_start is not None else elapsed
        frac = (elapsed - qa0) / max(budget - qa0, 1e-9)
        max_docs = 8 if args.curriculum <= 0 else min(8, 2 + int(6 * frac / args.curriculum))
        share, pair = phases.mix()
        if stream is None:
            ids, w, ans = make_batch(tok, rng, args.batch, max_docs, share, pair)
        else:
            stream.share.value, stream.pair_share.value, stream.max_docs.value = share, pair, max_docs
            ids, w, ans = (t.to(device, non_blocking=True) for t in next(batches))
        loss, acc = weighted_loss(model, ids, w, ans, copyable, args.copy_aux)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(ids.numel())
        losses.append(float(loss.detach()))
        accs.append(acc)
        phases.update(acc, step, elapsed)
        if step % args.log_every == 0:
            print(f"step {step} t={elapsed / 60:.1f}m loss {statistics.fmean(losses[-args.log_every:]):.4f} "
                  f"answer-token acc {statistics.fmean(accs[-args.log_every:]):.3f} "
                  f"({phases.name}) lr {opt.param_groups[0]['lr']:.2e} tok/s {tokens / max(elapsed - elapsed0, 1e-9):.0f}",
                  flush=True)
        if time.time() - last_save > 300:
            save(model, opt, tok, out, ckpt, step, time.time() - t0, rng, losses, phases)
            last_save = time.time()
    save(model, opt, tok, out, ckpt, step, time.time() - t0, rng, losses, phases)


def save(model: Any, opt: Any, tok: Any, out: Path, ckpt: Path, step: int, elapsed: float, rng: random.Random,
         losses: list[float], phases: Phases) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "rng": rng.getstate(), "phase": phases.name}, ckpt)
    log = ckpt.parent / "demo_model.train.json"
    # every command that trained these weights, in order (a --resume run appends itself)
    prev = json.loads(log.read_text()) if log.exists() else {}
    commands = prev.get("commands", [])
    if not commands or commands[-1] != COMMAND:
        commands.append(COMMAND)
    transitions = [t for t in prev.get("phases", []) if t not in phases.log] + phases.log
    info = {"steps": step, "train_minutes": round(elapsed / 60, 1),
            "final_loss": round(statistics.fmean(losses[-100:]), 4) if losses else None, "commands": commands,
            "phases": transitions}
    log.write_text(json.dumps(info))
    print(f"saved step {step} ({elapsed / 60:.1f} min)", flush=True)


def write_data(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    docs, world = dd.make_corpus()
    dd.write_jsonl(out / dd.CORPUS_FILE, docs)
    dd.write_jsonl(out / dd.HELDOUT_FILE, dd.make_heldout(docs, world))


def evaluate(out: Path, n: int, repairs: tuple[str, ...]) -> dict[str, Any]:
    """Exact-match accuracy of greedy answers over the first ``n`` held-out questions, per repair mode, with
    the corpus warmed (so "cacheblend" re-places document KV and "full" recomputes it all), in the layout of
    metrics.json (the measurement itself is the benchmark's, ``kvboost_rag.app.bench.quality.demo_accuracy``)."""
    from kvboost_rag.app.bench.quality import demo_accuracy

    acc = demo_accuracy(n, out, repairs)
    res: dict[str, Any] = {"questions": acc["questions"], "cacheblend_setting": acc["cacheblend_setting"]}
    for repair, m in acc["methods"].items():
        res[repair] = {"accuracy": round(m["accuracy"], 4), "single_hop": round(m["single_hop"], 4),
                       "two_hop": round(m["two_hop"], 4), "mean_reuse_ratio": round(m["reuse_ratio"], 4),
                       "by_template": m["by_template"]}
        print(repair, res[repair], flush=True)
    if "full" in repairs and "cacheblend" in repairs:
        # how often reuse changes the answer at all: meaningful even where the answers are wrong
        res["agreement"] = round(acc["methods"]["cacheblend"]["agreement_with_full"], 4)
    res["closed_book"] = {"accuracy": round(acc["closed_book_accuracy"], 4)}
    print("closed book", res["closed_book"], flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=dd.DEMO_MODEL_DIR)
    p.add_argument("--minutes", type=float, default=50.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ckpt-dir", type=Path, default=Path("build/demo_model"),
                   help="checkpoint and training log (kept out of the package assets)")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--card-only", action="store_true", help="rewrite MODEL_CARD.md from metrics.json")
    p.add_argument("--eval-questions", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--curriculum", type=float, default=0.3,
                   help="share of the time box over which the documents per sequence grow from 2 to 3-8")
    p.add_argument("--drill-share", type=float, default=0.2,
                   help="share of question-answering sequences that are copy drills (half of them two-token)")
    p.add_argument("--drill-until", type=float, default=0.85,
                   help="one-token drills only until their copy accuracy reaches this")
    p.add_argument("--drill-steps", type=int, default=4000, help="at most this many one-token drill steps")
    p.add_argument("--pair-until", type=float, default=0.75,
                   help="then two-token drills only until their copy accuracy reaches this")
    p.add_argument("--pair-drill-steps", type=int, default=1500, help="at most this many two-token drill steps")
    p.add_argument("--copy-aux", type=float, default=0.0, help="weight of the copy-supervision loss (0: off)")
    p.add_argument("--vocab", type=int, default=2400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu (fp32) or cuda (bf16 autocast); default: cuda when available")
    p.add_argument("--workers", type=int, default=0,
                   help="processes making batches (0: in the training process, resumable exactly)")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {MODEL_SHAPE['num_hidden_layers']})")
    p.add_argument("--keep-tokenizer", action="store_true", help="reuse the tokenizer already in --out")
    p.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--no-eval", action="store_true", help="train only; measure later with --eval-only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.card_only:
        write_card(args.out, json.loads((args.out / "metrics.json").read_text()), WEIGHTS, FLOOR_MARGIN)
        return
    if not args.eval_only:
        write_data(args.out)
        train(args, args.out)
        if args.no_eval:
            return
    metrics = evaluate(args.out, args.eval_questions, ("full", "cacheblend", "none"))
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
    write_card(args.out, metrics, WEIGHTS, FLOOR_MARGIN)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()

"""Teacher targets and losses for the block adapter's distillation (issue #32), computed once and kept on disk.

The teacher is the base model's plain full prefill of exactly the ids the engine serves. For each chat it gives,
at every **tail position** (from the end of the last document to the end of the teacher's greedy answer: the
question, the chat template's turn markers and the answer, teacher-forced):

- the next-token distribution, kept sparse: the top ``K`` log-probs and the log of the mass left over (``rest``);
- the final (normed) hidden state, fp16.

The student is the adapted model under block attention (:func:`kvboost_core.lora.block_prefill.block_hidden`), on the
same ids. Losses (all means over rows):

- :func:`sparse_kl`: KL(teacher || student) between the two distributions coarsened to the teacher's top ``K``
  tokens plus one bucket for everything else. It is the exact KL of those coarsened distributions, a lower bound
  of the full KL, and equal to it when the teacher's rest mass is zero;
- :func:`hidden_loss`: squared error of the final hidden states relative to the teacher's squared norm;
- ``answer`` recipe: the KL on the answer rows only (the recipe of the shipped adapter); ``dense``: every tail row
  plus ``hidden_weight`` times the hidden loss;
- ``full_weight``: the same loss once more for the adapted model's own plain full-attention prefill of the same
  ids (:func:`full_hidden`), so the adapter learns block reading without moving what the model does under full
  attention (on dev2 the adapter's own full prefill answered 2.2 points below the base model's).

Targets are written in shards of ``SHARD`` chats (``targets-00000.pt``...), each complete before it is renamed into
place, so a killed run resumes at the first missing shard. torch loads on first use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvboost_core.lora.block_prefill import Run

TOP_K = 64
SHARD = 32


@dataclass(slots=True)
class Target:
    ids: list[int]  # the prompt's ids, as the engine tokenizes them
    runs: list[Run]  # which positions come from which isolated document
    tail_from: int  # the first position after the last placed document token
    answer: list[int]  # the teacher's greedy answer (EOS included when it ended)
    top_idx: torch.Tensor  # (R, K) int32: the teacher's top tokens at rows tail_from .. len(ids) + len(answer) - 2
    top_logp: torch.Tensor  # (R, K) fp16 log-probs of those tokens
    rest_logp: torch.Tensor  # (R,) fp32: log of the teacher's mass outside the top K
    hidden: torch.Tensor  # (R, d) fp16: the teacher's final hidden states at those rows
    kind: str = ""
    gold: list[int] | None = None  # the gold answer's ids, where the chat has one

    @property
    def rows(self) -> int:
        return len(self.ids) - self.tail_from + len(self.answer) - 1

    @property
    def answer_rows(self) -> int:
        return len(self.answer)


def tail_start(runs: Sequence[Run]) -> int:
    """The first position after the last run taken from a document (0 when there is none)."""
    ends = [r.end for r in runs if r.doc is not None]
    return max(ends) if ends else 0


def _sparse(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    logp = torch.log_softmax(logits.float(), -1)
    top_logp, top_idx = logp.topk(k, -1)
    rest = torch.logsumexp(logp.scatter(-1, top_idx, float("-inf")), -1)
    return top_idx.to(torch.int32), top_logp.to(torch.float16), rest


def teacher_target(model: Any, ids: Sequence[int], runs: Sequence[Run], max_new_tokens: int, eos: set[int],
                   top_k: int = TOP_K, kind: str = "", gold: list[int] | None = None) -> Target:
    """The base model's full prefill of ``ids``, its greedy answer, and its sparse distributions and hidden
    states at every tail row (one prefill and one decode step per answer token)."""
    import torch

    from kvboost_core.model.driver import output_cache

    tail = tail_start(runs)
    if not 0 < tail < len(ids):
        raise ValueError(f"the prompt needs a document before its last token (tail at {tail} of {len(ids)})")
    with torch.inference_mode():
        device = next(model.parameters()).device
        out = model.model(input_ids=torch.tensor([list(ids)], device=device), use_cache=True)
        hs = [out.last_hidden_state[0, tail:]]
        logits = model.lm_head(hs[0]).float()
        cache, answer, rows = output_cache(out), [], [logits]
        nxt = int(logits[-1].argmax())
        while True:
            answer.append(nxt)
            if nxt in eos or len(answer) >= max_new_tokens:
                break
            out = model.model(input_ids=torch.tensor([[nxt]], device=device), cache=cache, use_cache=True)
            cache = output_cache(out)
            hs.append(out.last_hidden_state[0, -1:])
            rows.append(model.lm_head(hs[-1]).float())
            nxt = int(rows[-1][-1].argmax())
        top_idx, top_logp, rest = _sparse(torch.cat(rows), top_k)
        hidden = torch.cat(hs).to(torch.float16).cpu()
        top_idx, top_logp, rest = top_idx.cpu(), top_logp.cpu(), rest.cpu()
    return Target(list(ids), list(runs), tail, answer, top_idx, top_logp, rest, hidden, kind, gold)


def sparse_kl(t_idx: torch.Tensor, t_logp: torch.Tensor, t_rest: torch.Tensor, s_logp: torch.Tensor
              ) -> torch.Tensor:
    """Per-row KL(teacher || student) over the teacher's top-K tokens plus one rest bucket. ``s_logp``: (R, V)
    student log-probs; the teacher's rows as stored (:class:`Target`). Returns (R,)."""
    import torch

    idx = t_idx.long()
    tl = t_logp.float()
    s_top = s_logp.gather(-1, idx)
    s_rest = torch.logsumexp(s_logp.scatter(-1, idx, float("-inf")), -1)
    r = t_rest.float()
    return (tl.exp() * (tl - s_top)).sum(-1) + r.exp() * (r - s_rest)


def hidden_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-row squared error of the hidden states relative to the teacher's squared norm. (R,)"""
    t = teacher.float()
    return ((student.float() - t) ** 2).sum(-1) / (t**2).sum(-1).clamp_min(1e-6)


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a training step minimises (fixed for a run; the per-step state is the sample)."""

    rows: str = "answer"  # "answer": the answer rows only; "dense": every tail row
    hidden_weight: float = 0.0  # times the hidden-state loss over the same rows
    gold_weight: float = 0.0  # times the cross-entropy of the gold answer (an extra pass, where a chat has one)
    links: int = 0  # link slots after each document (kvboost_core.lora.block_links), trained with the LoRA
    full_weight: float = 0.0  # times the same row loss of the adapted model's plain full prefill (an extra pass)

    def __post_init__(self) -> None:
        if self.rows not in ("answer", "dense"):
            raise ValueError(f"rows must be 'answer' or 'dense', got {self.rows!r}")
        if min(self.hidden_weight, self.gold_weight, self.links, self.full_weight) < 0:
            raise ValueError("hidden_weight, gold_weight, links and full_weight must be >= 0")


RECIPES = {"a": Recipe("answer"), "b": Recipe("dense", hidden_weight=0.5),
           "c": Recipe("dense", hidden_weight=0.5, gold_weight=0.5),
           "d": Recipe("dense", hidden_weight=0.5, links=4),
           "e": Recipe("dense", hidden_weight=0.5, full_weight=1.0)}
LINK_FILL_ID = 0  # the placeholder id of a link slot (never embedded: the slot's input is the table's row)


def student_view(t: Target, extra: Sequence[int], n_links: int) -> tuple[list[int], list[Run], int]:
    """The student's ids (the prompt, then ``extra`` teacher-forced tokens), runs and first tail row, with
    ``n_links`` link slots after every document (the tail's rows are the teacher's, shifted)."""
    from kvboost_core.lora.block_links import insert_links, shift_of

    ids, runs = insert_links(t.ids + list(extra), t.runs, n_links, LINK_FILL_ID)
    return ids, runs, t.tail_from + shift_of(t.runs, n_links)


def student_loss(model: Any, lead: Sequence[int], t: Target, recipe: Recipe,
                 encoded: dict | None = None, links: torch.Tensor | None = None) -> torch.Tensor:
    """The recipe's loss of the (gated) adapted model under block attention on ``t``: differentiable.
    ``links``: the link table's rows when ``recipe.links`` > 0. Runs the one-pass construction
    (:mod:`kvboost_core.lora.block_fused`, what training needs) unless :data:`FUSED` is off or ``encoded`` (a dict
    of reference encodings shared with :func:`~kvboost_core.lora.block_prefill.block_greedy`) is given."""
    import torch

    if recipe.links and (links is None or links.shape[0] != recipe.links):
        raise ValueError(f"recipe has {recipe.links} link slots; pass a link table of as many rows")
    hidden = _hidden_fn(model, lead, t, encoded, links)
    ids, runs, tail = student_view(t, t.answer[:-1], recipe.links)
    first = first_row(t, recipe)
    loss = rows_loss(model, hidden(ids, runs, tail)[first:], t, first, recipe.hidden_weight)
    if recipe.full_weight:
        loss = loss + recipe.full_weight * full_loss(model, t, recipe)
    if recipe.gold_weight and t.gold:
        gids, gruns, _ = student_view(t, t.gold[:-1], recipe.links)
        hg = hidden(gids, gruns, len(gids) - len(t.gold))
        ce = torch.nn.functional.cross_entropy(model.lm_head(hg).float(), torch.tensor(t.gold, device=hg.device))
        loss = loss + recipe.gold_weight * ce
    return loss


def rows_loss(model: Any, h: torch.Tensor, t: Target, first: int, hidden_weight: float) -> torch.Tensor:
    """Mean sparse KL (plus ``hidden_weight`` times the hidden loss) of the student's final hidden states ``h``
    (R - first, d) against the teacher's tail rows ``first..``."""
    import torch

    s_logp = torch.log_softmax(model.lm_head(h).float(), -1)
    dev = h.device
    loss = sparse_kl(t.top_idx[first:].to(dev), t.top_logp[first:].to(dev), t.rest_logp[first:].to(dev),
                     s_logp).mean()
    if hidden_weight:
        loss = loss + hidden_weight * hidden_loss(h, t.hidden[first:].to(dev)).mean()
    return loss


def first_row(t: Target, recipe: Recipe) -> int:
    """The first of the target's tail rows the recipe's loss reads: 0 (dense) or the first answer row."""
    return 0 if recipe.rows == "dense" else t.rows - t.answer_rows


def full_loss(model: Any, t: Target, recipe: Recipe) -> torch.Tensor:
    """The recipe's row loss (KL, plus its hidden-state term) of the (gated) model's plain full-attention prefill
    of ``t``, without link slots: recipe ``e``'s extra term, and with ``Recipe("answer")`` the drift
    :func:`kvboost_rag.app.adapt_block.evaluate` reports. Differentiable."""
    first = first_row(t, recipe)
    return rows_loss(model, full_hidden(model, t)[first:], t, first, recipe.hidden_weight)


def full_hidden(model: Any, t: Target) -> torch.Tensor:
    """The (gated) model's plain full-attention prefill of the teacher's ids and answer: the final hidden states
    at the tail rows, (R, d), aligned with the target's rows. Differentiable."""
    import torch

    device = next(model.parameters()).device
    out = model.model(input_ids=torch.tensor([t.ids + t.answer[:-1]], device=device))
    return out.last_hidden_state[0, t.tail_from:]


FUSED = True  # student_loss's construction: the one-pass block_fused (off: block_prefill's run-by-run reference)


def _hidden_fn(model: Any, lead: Sequence[int], t: Target, encoded: dict | None, links: torch.Tensor | None
               ) -> Callable[[list[int], list[Run], int], torch.Tensor]:
    """hidden(ids, runs, rows_from) -> (n_out, d) under block attention, the documents encoded once for all calls."""
    from kvboost_core.lora.block_fused import encode_stacked, fused_block_hidden
    from kvboost_core.lora.block_prefill import block_hidden

    if FUSED and encoded is None:
        placed = [r.doc for r in t.runs if r.doc is not None]
        docs = encode_stacked(model, placed, lead) if placed else None
        return lambda ids, runs, rows_from: fused_block_hidden(model, ids, runs, lead, rows_from=rows_from,
                                                               docs=docs, links=links)
    shared = {} if encoded is None else encoded
    return lambda ids, runs, rows_from: block_hidden(model, ids, runs, lead, rows_from=rows_from,
                                                     encoded=shared, links=links)[0]


# ---- targets on disk ------------------------------------------------------------------------------------------

def shard_path(root: str, i: int) -> str:
    return os.path.join(root, f"targets-{i:05d}.pt")


def _to_dict(t: Target) -> dict[str, Any]:
    """A target as stored: runs as plain tuples, so a shard does not depend on the Run class's layout."""
    out = {f: getattr(t, f) for f in Target.__slots__}
    out["runs"] = [(r.start, r.end, r.doc, r.offset, r.link) for r in t.runs]
    return out


def _from_dict(d: dict[str, Any]) -> Target:
    from kvboost_core.lora.block_prefill import Run

    def run(r: Any) -> Run:
        if isinstance(r, tuple):
            return Run(*r)
        return Run(r.start, r.end, r.doc, r.offset, getattr(r, "link", False))  # a shard of an earlier layout

    return Target(**{**d, "runs": [run(r) for r in d["runs"]]})


# Modules whose classes shards of earlier layouts pickled, under their present names.
MOVED_MODULES = {"kvboost_core.block_prefill": "kvboost_core.lora.block_prefill"}


def _shard_pickle() -> Any:
    """A pickle module for ``torch.load`` that finds classes under their moved modules (:data:`MOVED_MODULES`)."""
    import pickle
    import types

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return super().find_class(MOVED_MODULES.get(module, module), name)

    return types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pickle")


def _read_shard(path: str) -> dict[str, Any]:
    import torch

    try:
        raw = torch.load(path, weights_only=False, pickle_module=_shard_pickle())
        if not (isinstance(raw, dict) and {"first", "end", "targets"} <= raw.keys()):
            raise ValueError("not a teacher shard (no first/end/targets)")
        return raw
    except Exception as exc:  # noqa: BLE001 - a corrupt shard names itself
        raise ValueError(f"corrupt teacher shard {path}: {exc}") from exc


def load_targets(root: str, limit: int | None = None) -> list[Target]:
    """The targets of the shards under ``root``, in chat order (at most ``limit``)."""
    out: list[Target] = []
    i = 0
    while os.path.isfile(shard_path(root, i)) and (limit is None or len(out) < limit):
        out += [_from_dict(d) for d in _read_shard(shard_path(root, i))["targets"]]
        i += 1
    return out[:limit] if limit is not None else out


def build_targets(root: str, n: int, make: Callable[[int], Target | None], log: Any = print,
                  worker: tuple[int, int] = (0, 1)) -> list[Target]:
    """Targets of chats ``0..n-1`` (``make(i)``; None skips a chat) in shards of :data:`SHARD` chats under
    ``root``. A shard records the chats it covers: complete shards are kept, a missing or short one (an earlier,
    smaller ``n``) is computed, so a killed or extended run resumes where it stopped. Returns the targets (at most
    ``n``), read once from the shards. ``worker=(w, W)``: compute only the shards ``s`` with ``s % W == w`` and
    return nothing, so W processes (on a GPU: one model each) fill one directory side by side; a later call with
    the default reads them all."""
    import torch
    from tqdm import tqdm

    w, n_workers = worker
    if not (n_workers >= 1 and 0 <= w < n_workers):
        raise ValueError(f"worker must be (w, W) with 0 <= w < W, got {worker}")
    os.makedirs(root, exist_ok=True)
    shards = range(-(-n // SHARD))
    todo = [s for s in shards if s % n_workers == w and not _complete(root, s, min((s + 1) * SHARD, n))]
    done = sum(min((s + 1) * SHARD, n) - s * SHARD for s in shards if s % n_workers == w and s not in todo)
    if done:
        log(f"teacher targets: {done} of {n} chats already under {root}")
    t0 = time.process_time()
    bar = tqdm(total=n, initial=done, desc="teacher targets", mininterval=30)
    for s in todo:
        start, end = s * SHARD, min((s + 1) * SHARD, n)
        shard = [_to_dict(t) for t in (make(i) for i in range(start, end)) if t is not None]
        tmp = shard_path(root, s) + ".tmp"
        torch.save({"first": start, "end": end, "targets": shard}, tmp)
        os.replace(tmp, shard_path(root, s))
        bar.update(end - start)
    bar.close()
    log(f"teacher targets: {n} chats under {root} ({time.process_time() - t0:.0f} CPU-s this run)")
    if n_workers > 1:
        return []
    return load_targets(root, n)


def _complete(root: str, s: int, end: int) -> bool:
    """Shard ``s`` exists and covers its chats up to ``end``."""
    path = shard_path(root, s)
    return os.path.isfile(path) and _read_shard(path)["end"] >= end

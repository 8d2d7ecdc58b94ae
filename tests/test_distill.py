"""Block-adapter distillation (issue #32): the sparse KL against a hand computation, teacher targets against a
plain forward, the student's rows against the teacher's on the same model, target shards and the resumable loop."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CORPUS, make_tiny_model

from kvboost_core.lora.reader import ReaderAdapter
from kvboost_rag.app import distill
from kvboost_rag.app.trainer import TrainState, budget_progress, order, schedule, train

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]


def test_sparse_kl_is_the_kl_of_the_coarsened_distributions_by_hand():
    # vocabulary of 4, teacher top-2 = tokens 2 and 0; the rest bucket holds tokens 1 and 3
    t = torch.tensor([0.1, 0.2, 0.6, 0.1])
    s = torch.tensor([0.25, 0.25, 0.25, 0.25])
    idx = torch.tensor([[2, 0]], dtype=torch.int32)
    t_logp = t[[2, 0]].log().view(1, 2).half()
    rest = torch.tensor([math.log(0.3)])
    got = distill.sparse_kl(idx, t_logp, rest, s.log().view(1, 4))
    want = (0.6 * (math.log(0.6) - math.log(0.25)) + 0.1 * (math.log(0.1) - math.log(0.25))
            + 0.3 * (math.log(0.3) - math.log(0.5)))
    assert abs(float(got[0]) - want) < 2e-3, (got, want)
    # equal distributions: zero; a student that moves mass off the teacher's top: positive
    assert abs(float(distill.sparse_kl(idx, t_logp, rest, t.log().view(1, 4))[0])) < 2e-3
    assert float(got[0]) > 0.1


def test_hidden_loss_is_relative_squared_error():
    t = torch.tensor([[3.0, 4.0]])
    assert float(distill.hidden_loss(t, t)[0]) == 0.0
    assert abs(float(distill.hidden_loss(torch.tensor([[3.0, 0.0]]), t)[0]) - 16 / 25) < 1e-6


@pytest.fixture(scope="module")
def setup(warmed_block):
    return warmed_block


def test_teacher_target_rows_are_the_full_prefill_along_its_answer(setup):
    model, _, ids, runs = setup
    t = distill.teacher_target(model, ids, runs, 6, set(), top_k=8)
    assert t.tail_from == distill.tail_start(runs) and 0 < t.tail_from < len(ids)
    assert len(t.answer) == 6 and t.rows == len(ids) - t.tail_from + 5
    assert t.top_idx.shape == (t.rows, 8) and t.hidden.shape[0] == t.rows
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + t.answer[:-1]])).logits[0, t.tail_from:].float()
    logp = torch.log_softmax(logits, -1)
    top, idx = logp.topk(8, -1)
    assert torch.equal(idx.int(), t.top_idx)
    assert (top - t.top_logp.float()).abs().max() < 2e-2  # fp16 storage
    rest = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))
    assert (rest - t.rest_logp).abs().max() < 1e-3
    assert [int(x) for x in logits[len(ids) - 1 - t.tail_from:].argmax(-1)] == t.answer  # greedy, teacher-forced


def test_student_under_full_attention_has_zero_loss_and_block_attention_does_not(setup):
    """The student's rows are aligned with the teacher's: with no document placed (every position computed in
    one causal pass) the student is the teacher and every loss is ~0; under block attention it is not."""
    from kvboost_core.lora.block_prefill import Run

    model, eng, ids, runs = setup
    t = distill.teacher_target(model, ids, runs, 6, set())
    lead = list(eng._warm_prefix)
    full = distill.Target(t.ids, [Run(0, len(ids))], t.tail_from, t.answer, t.top_idx, t.top_logp, t.rest_logp,
                          t.hidden)
    with torch.inference_mode():
        for recipe in distill.RECIPES.values():
            if not recipe.links:  # link slots change the prompt: no longer the teacher's (test_block_links)
                assert float(distill.student_loss(model, lead, full, recipe)) < 2e-3
        assert float(distill.student_loss(model, lead, t, distill.RECIPES["b"])) > 1e-3


def test_full_attention_term_is_the_plain_prefills_kl_and_trains_the_adapter(setup):
    """Recipe e's extra term is the row loss of a plain HF forward of the teacher's ids under the adapter: ~0 on
    the base weights (the student is then the teacher), equal to a hand computation from ``model(...).logits`` on
    perturbed weights, and it reaches the LoRA weights through the gradient."""
    _, eng, ids, runs = setup
    model, lora = _fresh_lora()  # its own model: the shared one stays without modules
    t = distill.teacher_target(model, ids, runs, 6, set())  # the gate closed: the base model
    lead = list(eng._warm_prefix)
    plain, with_full = distill.Recipe("dense"), distill.Recipe("dense", full_weight=2.0)
    with lora.gated(True), torch.inference_mode():
        base_gap = distill.student_loss(model, lead, t, with_full) - distill.student_loss(model, lead, t, plain)
    assert abs(float(base_gap)) < 2e-3  # B = 0 at attach: the adapter is the base model
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lora.parameters():
            p.normal_(0, 0.3)
    with lora.gated(True):
        with torch.inference_mode():
            gap = distill.student_loss(model, lead, t, with_full) - distill.student_loss(model, lead, t, plain)
            logits = model(input_ids=torch.tensor([ids + t.answer[:-1]])).logits[0, t.tail_from:].float()
        want = distill.sparse_kl(t.top_idx, t.top_logp, t.rest_logp, torch.log_softmax(logits, -1)).mean()
        assert float(want) > 1e-2 and abs(float(gap) - 2 * float(want)) < 1e-4 * max(1.0, float(want))
        for p in lora.parameters():
            p.requires_grad_(True)
        first = t.rows - t.answer_rows
        distill.rows_loss(model, distill.full_hidden(model, t)[first:], t, first, 0.5).backward()
    assert all(p.grad is not None for p in lora.parameters())
    assert sum(float(p.grad.abs().sum()) for p in lora.parameters()) > 0


def test_recipes_reject_bad_values():
    with pytest.raises(ValueError, match="rows"):
        distill.Recipe("all")
    with pytest.raises(ValueError, match=">= 0"):
        distill.Recipe("dense", hidden_weight=-1)
    with pytest.raises(ValueError, match="full_weight"):
        distill.Recipe("dense", full_weight=-0.5)


def test_shards_resume_and_a_corrupt_shard_names_itself(setup, tmp_path, monkeypatch):
    model, _, ids, runs = setup
    monkeypatch.setattr(distill, "SHARD", 2)
    made: list[int] = []

    def make(i):
        made.append(i)
        return distill.teacher_target(model, ids, runs, 3, set())

    assert len(distill.build_targets(str(tmp_path), 3, make, log=lambda *_: None)) == 3
    assert made == [0, 1, 2]
    made.clear()
    assert len(distill.build_targets(str(tmp_path), 5, make, log=lambda *_: None)) == 5
    assert made == [2, 3, 4]  # shard 0 (chats 0-1) is kept; shard 1 held chat 2 only, so it is redone
    got = distill.load_targets(str(tmp_path))
    assert len(got) == 5 and got[0].answer == got[4].answer
    assert len(distill.load_targets(str(tmp_path), limit=3)) == 3
    (tmp_path / "targets-00001.pt").write_bytes(b"not a shard")
    with pytest.raises(ValueError, match="corrupt teacher shard .*targets-00001.pt"):
        distill.load_targets(str(tmp_path))


def test_workers_fill_one_directory_side_by_side(setup, tmp_path, monkeypatch):
    model, _, ids, runs = setup
    monkeypatch.setattr(distill, "SHARD", 2)
    made: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def maker(w):
        def make(i):
            made[w].append(i)
            return distill.teacher_target(model, ids, runs, 2, set()) if i != 3 else None  # None: chat skipped
        return make

    quiet = {"log": lambda *_: None}
    assert distill.build_targets(str(tmp_path), 7, maker(0), worker=(0, 2), **quiet) == []
    assert distill.build_targets(str(tmp_path), 7, maker(1), worker=(1, 2), **quiet) == []
    assert made[0] == [0, 1, 4, 5] and made[1] == [2, 3, 6]  # shards 0, 2 and 1, 3
    got = distill.build_targets(str(tmp_path), 7, maker(2), **quiet)
    assert made[2] == [] and len(got) == 6  # every shard complete: read, none recomputed
    with pytest.raises(ValueError, match="worker must be"):
        distill.build_targets(str(tmp_path), 7, maker(2), worker=(2, 2), **quiet)


def _fresh_lora(seed=0):
    model = make_tiny_model("llama")
    torch.manual_seed(seed)
    lora = ReaderAdapter.attach(model, rank=2, alpha=4.0, base_fingerprint="x")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, lora


def _run(setup, targets, ckpt, steps, stop_after=None):
    _, eng, _, _ = setup
    model, lora = _fresh_lora()
    lead = list(eng._warm_prefix)
    calls = {"n": 0}

    def loss_at(i):
        calls["n"] += 1
        if stop_after is not None and calls["n"] > stop_after:
            raise KeyboardInterrupt
        return distill.student_loss(model, lead, targets[i], distill.RECIPES["b"])

    with lora.gated(True):
        try:
            st = train(lora.parameters(), len(targets), loss_at, steps=steps, lr=1e-2, seed=3, ckpt=ckpt, every=1,
                       state_dict=lora.state_dict, load_state_dict=lora.load_state_dict, log=lambda *_: None)
        except KeyboardInterrupt:
            return None, lora
    return st, lora


def test_a_resumed_run_reaches_the_uninterrupted_state(setup, tmp_path):
    model, _, ids, runs = setup
    targets = [distill.teacher_target(model, ids, runs, 4, set()),
               distill.teacher_target(model, ids[:-2], runs[:-1] + [runs[-1].__class__(runs[-1].start, len(ids) - 2)],
                                      4, set())]
    whole, lora_whole = _run(setup, targets, str(tmp_path / "a.pt"), steps=4)
    assert whole is not None and whole.step == 4
    ckpt = str(tmp_path / "b.pt")
    cut, _ = _run(setup, targets, ckpt, steps=4, stop_after=2)
    assert cut is None  # killed in step 3; the checkpoint holds step 2
    resumed, lora_resumed = _run(setup, targets, ckpt, steps=4)
    assert resumed is not None and resumed.step == 4 and resumed.losses == whole.losses
    a, b = lora_whole.state_dict(), lora_resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "c.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt training checkpoint"):
        _run(setup, targets, str(tmp_path / "c.pt"), steps=4)


def test_schedule_and_order():
    assert order(3, 7, 0) == order(3, 7, 0) and sorted(order(3, 6, 0)) == [0, 0, 1, 1, 2, 2]
    assert schedule(0, 100, 1.0) == pytest.approx(0.2)  # warm-up over 5 steps
    assert schedule(99, 100, 1.0) < 0.01
    assert schedule(10, 100, 1.0, progress=0.99) < 0.01  # a CPU budget nearly spent decays the rate
    # a budget much smaller than ``steps``: the warm-up ends with 5% of the budget, not 5% of the steps
    assert schedule(0, 10_000, 1.0, progress=0.06) > 0.9 and schedule(0, 10_000, 1.0, progress=0.01) < 0.25
    st = TrainState(cpu_s=30.0, wall_s=90.0)
    assert budget_progress(st, None, None) is None and budget_progress(st, 1.0, None) == pytest.approx(0.5)
    assert budget_progress(st, 1.0, 2.0) == pytest.approx(0.75)  # the larger fraction spent leads
    with pytest.raises(ValueError, match="lr"):
        train([], 1, lambda i: None, steps=1, lr=0.0, seed=0)


def test_a_shard_pickled_before_block_prefill_moved_still_loads(tmp_path, monkeypatch):
    """Shards written when Run lived in kvboost_core.block_prefill (objects, not tuples) read back as Runs."""
    import sys

    from kvboost_core.lora import block_prefill
    from kvboost_core.lora.block_prefill import Run

    runs = [Run(0, 3), Run(3, 7, (5, 6, 7, 8), 0)]
    monkeypatch.setitem(sys.modules, "kvboost_core.block_prefill", block_prefill)
    monkeypatch.setattr(Run, "__module__", "kvboost_core.block_prefill")
    torch.save({"first": 0, "end": 1, "targets": [{"runs": runs}]}, tmp_path / "old.pt")
    monkeypatch.undo()
    assert "kvboost_core.block_prefill" not in sys.modules and Run.__module__ == "kvboost_core.lora.block_prefill"
    raw = distill._read_shard(str(tmp_path / "old.pt"))
    assert raw["targets"][0]["runs"] == runs

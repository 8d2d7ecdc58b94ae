"""The one-pass block construction (kvboost_core.lora.block_fused), what adapter training runs, against the
run-by-run reference (kvboost_core.lora.block_prefill): the same hidden states, the same gradients, link slots
included, on a tiny Llama whose prompt places three warmed documents."""

from __future__ import annotations

import pytest
import torch

from kvboost_core.lora.block_fused import encode_stacked, fused_block_hidden
from kvboost_core.lora.block_links import LinkTable, insert_links
from kvboost_core.lora.block_prefill import Run, block_hidden
from kvboost_rag.app import distill

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(warmed_block):
    """The shared prompt with the first two tokens of every document after the first computed in the main pass
    (separators between documents, and placed runs that start at an offset into their document)."""
    model, eng, ids, plain = warmed_block
    runs: list[Run] = []
    for r in plain:
        if r.doc is not None and any(q.doc is not None for q in runs):
            runs += [Run(r.start, r.start + 2), Run(r.start + 2, r.end, r.doc, r.offset + 2)]
        else:
            runs.append(r)
    assert sum(r.doc is not None for r in runs) == 3 and sum(r.doc is None for r in runs) == 4
    return model, list(eng._warm_prefix), ids, runs


def test_fused_equals_the_reference_at_every_computed_row(setup):
    model, lead, ids, runs = setup
    extra = [5, 6, 7]  # teacher-forced tokens past the runs
    with torch.inference_mode():
        for rows_from in (0, runs[-1].start, len(ids)):
            a, _ = block_hidden(model, ids + extra, runs, lead, rows_from=rows_from)
            b = fused_block_hidden(model, ids + extra, runs, lead, rows_from=rows_from)
            assert a.shape == b.shape and a.shape[0] >= len(extra)
            assert (a - b).abs().max() < TOL


def test_fused_gradients_equal_the_references(setup):
    model, lead, ids, runs = setup
    params = [model.model.layers[0].self_attn.k_proj.weight, model.model.layers[-1].mlp.up_proj.weight]
    grads = []
    for fn in (lambda: block_hidden(model, ids, runs, lead, rows_from=runs[-1].start)[0],
               lambda: fused_block_hidden(model, ids, runs, lead, rows_from=runs[-1].start)):
        for p in params:
            p.grad = None
            p.requires_grad_(True)
        (fn().float() ** 2).mean().backward()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    for ga, gb in zip(*grads):
        assert ga.abs().sum() > 0 and (ga - gb).abs().max() <= TOL * max(1.0, float(ga.abs().max()))


def test_fused_link_slots_and_reused_encodings(setup):
    model, lead, ids, runs = setup
    table = LinkTable(model, 2, 3)()
    lid, lruns = insert_links(ids, runs, 2, 0)
    docs = encode_stacked(model, [r.doc for r in lruns if r.doc is not None], lead)
    with torch.inference_mode():
        a, _ = block_hidden(model, lid, lruns, lead, rows_from=0, links=table)
        b = fused_block_hidden(model, lid, lruns, lead, rows_from=0, docs=docs, links=table)
        assert (a - b).abs().max() < TOL
        with pytest.raises(ValueError, match="link slots"):
            fused_block_hidden(model, lid, lruns, lead, rows_from=0, docs=docs, links=table[:1])
        with pytest.raises(ValueError, match="lacks 1"):
            other = encode_stacked(model, [r.doc for r in lruns if r.doc is not None][:-1], lead)
            fused_block_hidden(model, lid, lruns, lead, rows_from=0, docs=other, links=table)
    with torch.inference_mode():  # no document placed: the model's own causal forward
        plain = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert (fused_block_hidden(model, ids, [Run(0, len(ids))], lead, rows_from=0) - plain).abs().max() < TOL


def test_student_loss_uses_the_fused_pass_and_matches_the_reference(setup, monkeypatch):
    model, lead, ids, runs = setup
    t = distill.teacher_target(model, ids, runs, 5, set())
    recipe = distill.RECIPES["b"]
    with torch.inference_mode():
        fused = float(distill.student_loss(model, lead, t, recipe))
        monkeypatch.setattr(distill, "FUSED", False)
        ref = float(distill.student_loss(model, lead, t, recipe))
    assert fused > 0 and abs(fused - ref) <= 1e-4 * max(1.0, ref)

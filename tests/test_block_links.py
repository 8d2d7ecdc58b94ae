"""Link slots after each document (kvboost_core.lora.block_links): the prompt transformation, the slots' forward
against the same positions computed from token ids, the student's rows aligned with the teacher's, and an
adapter with links refused by the engine (it cannot serve them yet) rather than served without them."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import engine_for

from kvboost_core.lora.block_links import LinkTable, insert_links, shift_of
from kvboost_core.lora.block_prefill import Run, block_forward
from kvboost_rag.app import distill

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]


def test_insert_links_moves_everything_after_each_document():
    runs = [Run(0, 2), Run(2, 5, (7, 8, 9)), Run(5, 6), Run(6, 8, (1, 2)), Run(8, 10)]
    ids = list(range(100, 110)) + [200, 201]  # two teacher-forced tokens past the runs
    got_ids, got_runs = insert_links(ids, runs, 2, 0)
    assert got_ids == [100, 101, 102, 103, 104, 0, 0, 105, 106, 107, 0, 0, 108, 109, 200, 201]
    assert got_runs == [Run(0, 2), Run(2, 5, (7, 8, 9)), Run(5, 7, None, 0, True), Run(7, 8),
                        Run(8, 10, (1, 2)), Run(10, 12, None, 0, True), Run(12, 14)]
    assert shift_of(runs, 2) == 4 and insert_links(ids, runs, 0, 0) == (ids, runs)
    with pytest.raises(ValueError, match="n must be"):
        insert_links(ids, runs, -1, 0)


@pytest.fixture(scope="module")
def setup(warmed_block):
    return warmed_block


def test_link_slots_equal_the_same_positions_computed_from_ids(setup):
    """Slots whose table rows are token embeddings compute exactly what those tokens would, as computed runs."""
    model, eng, ids, runs = setup
    toks = [11, 12, 13]
    table = model.get_input_embeddings().weight[toks].detach()
    lid, lruns = insert_links(ids, runs, 3, 0)
    as_ids = [t if not any(r.link and r.start <= i < r.end for r in lruns) else toks[i - next(
        r.start for r in lruns if r.link and r.start <= i < r.end)] for i, t in enumerate(lid)]
    plain = [Run(r.start, r.end, r.doc, r.offset) for r in lruns]  # the same runs, slots as ordinary tokens
    lead = list(eng._warm_prefix)
    with torch.inference_mode():
        a, _ = block_forward(model, lid, lruns, lead, links=table, logits_from=0)
        b, _ = block_forward(model, as_ids, plain, lead, logits_from=0)
    assert a.shape == b.shape and (a - b).abs().max() < 1e-5
    with pytest.raises(ValueError, match="link slots"):
        block_forward(model, lid, lruns, lead)


def test_student_with_links_reads_the_teachers_rows(setup):
    model, eng, ids, runs = setup
    t = distill.teacher_target(model, ids, runs, 5, set())
    table = LinkTable(model, 4, 3)
    lead = list(eng._warm_prefix)
    recipe = distill.RECIPES["d"]
    sid, sruns, tail = distill.student_view(t, t.answer[:-1], 4)
    assert len(sid) == len(ids) + len(t.answer) - 1 + 4 * len(DOCS) and tail == t.tail_from + 4 * len(DOCS)
    assert sid[tail:] == (ids + t.answer[:-1])[t.tail_from:]  # the tail's tokens are the teacher's
    loss = distill.student_loss(model, lead, t, recipe, links=table())
    loss.backward()
    assert torch.isfinite(loss) and table.table.grad is not None and table.table.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="link table"):
        distill.student_loss(model, lead, t, recipe)


def test_engine_refuses_an_adapter_with_links(tmp_path, tokenizer):
    from kvboost_core.lora.block_adapter import TARGETS, BlockMeta, LoraHeader, save
    from kvboost_core.lora.reader import ReaderAdapter

    model = make_tiny_model("llama")
    eng = engine_for(model, tokenizer)
    lora = ReaderAdapter.attach(make_tiny_model("llama"), rank=2, alpha=4.0)
    save(str(tmp_path), lora.state_dict(), BlockMeta(LoraHeader(2, 4.0, TARGETS, str(eng.fingerprint)),
                                                     tuple(eng._warm_prefix), eng.config.sink_tokens))
    (tmp_path / "links.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="link slots"):
        engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(tmp_path))


def test_link_table_file_round_trip_and_clear_errors(tmp_path):
    from safetensors.torch import save_file

    from kvboost_core.lora.block_links import LINKS_FILE, load_table, save_table

    table = torch.randn(4, 8)
    save_table(str(tmp_path), table)
    assert torch.equal(load_table(str(tmp_path)), table)
    with pytest.raises(ValueError, match="has no link table"):
        load_table(str(tmp_path / "missing"))
    save_file({"other": torch.zeros(4, 8)}, str(tmp_path / LINKS_FILE))
    with pytest.raises(ValueError, match="holds no"):
        load_table(str(tmp_path))

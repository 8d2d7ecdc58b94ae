"""Transparent-mode finding: correctness of the anchor index and O(prompt) work per prompt."""

from __future__ import annotations

import numpy as np

from kvboost_rag.locate import MIN_CHARS, WINDOW, DocIndex, window_hashes
from kvboost_rag.registry import doc_key


def _doc(i: int, header: str = "") -> str:
    return f"{header}Record {i:05d}: item {i * 7919 % 10007} is stored in aisle {i % 97} on shelf {i % 13}. " \
           f"Its checksum is {i * 104729 % 1000003}."


def _index(docs: list[str]) -> DocIndex:
    index = DocIndex()
    for d in docs:
        index.add(doc_key(d), d)
    return index


def test_window_hashes_match_slices() -> None:
    text = "abcdefghij" * 10
    hs = window_hashes(text, 16)
    assert len(hs) == len(text) - 15
    for i in (0, 5, 40):
        assert hs[i] == window_hashes(text[i:i + 16], 16)[0]
    assert hs[0] == hs[10]  # same window text, same hash
    assert window_hashes("short", 16).size == 0


def test_finds_documents_in_order_with_exact_spans() -> None:
    docs = [_doc(i) for i in range(50)]
    index = _index(docs)
    prompt = "System: answer.\n\n" + "\n\n".join([docs[7], docs[3], docs[41]]) + "\n\nQuestion: where?"
    found = index.find(prompt)
    assert [m.key for m in found] == [doc_key(docs[i]) for i in (7, 3, 41)]
    for m, i in zip(found, (7, 3, 41), strict=True):
        assert prompt[m.start:m.end] == docs[i] and m.lead == 0


def test_per_prompt_work_does_not_scan_the_corpus() -> None:
    """2,000 registered documents, 3 in the prompt: the only string compares are for those 3."""
    big = _index([_doc(i) for i in range(2000)])
    small = _index([_doc(i) for i in range(20)])
    prompt = "Context:\n" + "\n\n".join(_doc(i) for i in (5, 11, 17)) + "\nQ: which aisle?" * 20
    assert len(big.find(prompt)) == 3 and len(small.find(prompt)) == 3
    assert big.last_confirmations == small.last_confirmations == 3
    assert big.find("nothing registered appears in this prompt at all, " * 40) == []
    assert big.last_confirmations == 0


def test_shared_headers_do_not_fan_out() -> None:
    """Documents sharing a long header (LlamaIndex metadata lines) get anchors past it."""
    header = "file_path: /data/warehouse/inventory/records.txt\ncategory: inventory\n\n"
    assert len(header) > WINDOW
    index = _index([_doc(i, header) for i in range(500)])
    prompt = "\n\n".join(_doc(i, header) for i in (1, 250)) + "\nQ?"
    assert len(index.find(prompt)) == 2
    assert index.last_confirmations <= 4


def test_short_documents_and_minimum() -> None:
    index = DocIndex()
    short, tiny = "Bob fixes bikes daily.", "Tiny note."
    assert MIN_CHARS <= len(short) < WINDOW and len(tiny) < MIN_CHARS
    index.add("short", short)
    index.add("tiny", tiny)
    found = index.find(f"A: {short} B: {tiny}")
    assert [m.key for m in found] == ["short"]  # below MIN_CHARS a document is not located (documented)


def test_stripped_variant_and_longest_match() -> None:
    doc = "\n  " + _doc(1) + "  \n"
    inner = _doc(1)[:40] + " and more."  # not registered: no match
    index = DocIndex()
    index.add("k", doc)
    found = index.find("ctx: " + doc.strip() + " | " + inner)
    assert len(found) == 1 and found[0].lead == 3
    assert found[0].end - found[0].start == len(doc.strip())
    # a document containing another: the longer one wins at the same start
    index.add("long", _doc(2) + " Extra sentence here.")
    index.add("short", _doc(2))
    found = index.find("x " + _doc(2) + " Extra sentence here. y")
    assert [m.key for m in found] == ["long"]


def test_index_is_consistent_after_many_adds() -> None:
    index = _index([_doc(i) for i in range(300)])
    assert len(index) == 300
    assert isinstance(index._hash_array(WINDOW), np.ndarray)

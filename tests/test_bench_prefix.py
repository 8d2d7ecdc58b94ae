"""The exact-prefix baselines' lookup (kvboost_rag.app.bench.prefix): the longest shared prefix wins."""

from __future__ import annotations

from kvboost_rag.app.bench.prefix import common_prefix, longest_prefix


def test_common_prefix_counts_leading_equal_ids():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5, 2], [1, 2]) == 0


def test_longest_prefix_picks_the_longest_then_the_earliest():
    entries = [([1, 2, 9], "a"), ([1, 2, 3, 9], "b"), ([1, 2, 3, 8], "c"), ([7], "d")]
    assert longest_prefix(entries, [1, 2, 3, 4]) == (3, "b")  # "c" ties with "b": the earlier one
    assert longest_prefix(entries, [1, 5]) == (1, "a")
    assert longest_prefix(entries, [7, 7]) == (1, "d")


def test_longest_prefix_without_a_shared_first_id_is_none():
    assert longest_prefix([([1, 2], "a")], [2, 1]) == (0, None)
    assert longest_prefix([], [1, 2]) == (0, None)
    assert longest_prefix([([1, 2], "a")], []) == (0, None)


def test_longest_prefix_may_cover_the_whole_prompt():
    """The cap at len(ids) - 1 (the last prompt token is computed for its logits) is the caller's."""
    assert longest_prefix([([1, 2, 3, 4], "a")], [1, 2, 3]) == (3, "a")
    assert longest_prefix(iter([([1, 2], "a")]), [1, 2]) == (2, "a")  # any iterable of entries

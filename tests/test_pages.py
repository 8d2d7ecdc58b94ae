"""The paged KV pool (kvboost_core.serving.pages): reference counts under a randomized stress of requests joining,
sharing, writing and leaving (cancelled and failed ones included), copy-on-write isolation, paged decode
attention against a dense float64 reference, the pool full, and bad arguments."""

from __future__ import annotations

import random

import pytest
import torch

from kvboost_core.model import attention
from kvboost_core.serving.pages import PagePool, PageTable, PoolFull, PoolStats, paged_attention


def _content(tokens: list[int], start: int, layer: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic K, V (H, n, D) for ``tokens`` at positions start.. : a function of (token, position, layer) alone
    (as a prefix chain fixes real KV), exact in float32 (small integers plus multiples of 1/256)."""
    tok = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32).view(1, -1, 1)
    lane = torch.arange(heads * dim, dtype=torch.float32).view(heads, 1, dim) / 256
    k = tok * 256 + pos + layer / 4 + lane
    return k, -k - 1


def _expected(tokens: list[int], layer: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not tokens:
        return torch.zeros(heads, 0, dim), torch.zeros(heads, 0, dim)
    return _content(tokens, 0, layer, heads, dim)


def _write(pool: PagePool, table: PageTable, tokens: list[int], start: int, layers: int | None = None) -> None:
    for layer in range(pool.num_layers if layers is None else layers):
        pool.write(table, layer, *_content(tokens, start, layer, pool.kv_heads, pool.head_dim), start)


def _check(pool: PagePool, table: PageTable, tokens: list[int]) -> None:
    assert table.tokens == len(tokens)
    for layer in range(pool.num_layers):
        k, v = pool.gather(table, layer)
        ek, ev = _expected(tokens, layer, pool.kv_heads, pool.head_dim)
        assert torch.equal(k, ek) and torch.equal(v, ev)


def _pool(pages: int, *, layers: int = 2, heads: int = 2, dim: int = 3, page_tokens: int = 4,
          dtype: torch.dtype = torch.float32) -> PagePool:
    one = 2 * layers * heads * page_tokens * dim * dtype.itemsize
    pool = PagePool(layers, heads, dim, page_tokens, byte_budget=pages * one + one - 1, dtype=dtype)
    assert pool.num_pages == pages and pool.page_bytes == one
    return pool


def _key(tokens: list[int], page: int, page_tokens: int) -> tuple:
    return ("chain", tuple(tokens[:(page + 1) * page_tokens]))


# -- reference counts under stress ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refcounts_return_to_zero_after_a_randomized_stress(seed):
    rng = random.Random(seed)
    pool = _pool(40)
    p_tok = pool.page_tokens
    docs = [[rng.randrange(4) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    live: list[list] = []  # [table, tokens written, tokens still to append]
    seen = dict.fromkeys(("shared", "shared_pages", "cow", "full", "cancelled", "fork", "left"), 0)

    def fail(req):
        req[0].release()
        live.remove(req)

    for _ in range(700):
        op = rng.random()
        if op < 0.2 or not live:  # join: share the published pages of the prompt's prefix, append the rest later
            prompt = list(rng.choice(docs)) + [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
            table, n = PageTable(pool), 0
            while (n + 1) * p_tok <= len(prompt) and (page := pool.lookup(_key(prompt, n, p_tok))) is not None:
                table.share(page)
                n += 1
                seen["shared"] += 1
            live.append([table, prompt[:n * p_tok], prompt[n * p_tok:]])
            continue
        req = rng.choice(live)
        table, tokens, todo = req
        if op < 0.55:  # append a chunk (the prompt's rest, then generated tokens), publish the pages it filled
            n = rng.randrange(1, 7)
            new = (todo[:n] + [rng.randrange(4) for _ in range(n)])[:n]
            start = table.tokens
            try:
                table.slots_for(n)
            except PoolFull:
                seen["full"] += 1
                fail(req)  # the request fails: its table is released
                continue
            if rng.random() < 0.1:  # cancelled mid-step: room reserved, one layer written
                _write(pool, table, new, start, layers=1)
                seen["cancelled"] += 1
                fail(req)
                continue
            before = list(table.pages)
            try:
                _write(pool, table, new, start)
            except PoolFull:
                seen["full"] += 1
                fail(req)
                continue
            seen["cow"] += sum(a != b for a, b in zip(before, table.pages))
            tokens += new
            del todo[:n]
            for i in range(start // p_tok, table.tokens // p_tok):
                pool.publish(_key(tokens, i, p_tok), table.pages[i])
        elif op < 0.7 and tokens:  # rewrite an earlier position (copy-on-write when the page is shared)
            pos = rng.randrange(len(tokens))
            tok = (tokens[pos] + 1) % 4
            before = list(table.pages)
            try:
                _write(pool, table, [tok], pos)
            except PoolFull:
                seen["full"] += 1
                fail(req)
                continue
            seen["cow"] += sum(a != b for a, b in zip(before, table.pages))
            tokens[pos] = tok
        elif op < 0.8 and len(tokens) == table.tokens:  # fork (parallel sampling)
            live.append([table.fork(), list(tokens), []])
            seen["fork"] += 1
        else:  # leave
            fail(req)
            seen["left"] += 1
        # invariants: a page's count is the number of table entries naming it; published pages are in use
        held: dict[int, int] = {}
        for t, *_ in live:
            for p in t.pages:
                held[p] = held.get(p, 0) + 1
        assert all(pool.refcount(p) == held.get(p, 0) for p in range(pool.num_pages))
        stats = pool.stats()
        assert stats.used == len(held) and stats.free == pool.num_pages - len(held) == pool.free
        assert stats.published <= stats.used
        seen["shared_pages"] += stats.shared > 0
        other = rng.choice(live) if live else None
        if other is not None and len(other[1]) == other[0].tokens:
            _check(pool, other[0], other[1])  # nobody's write reached another request's contents
    for table, tokens, _ in list(live):
        if len(tokens) == table.tokens:
            _check(pool, table, tokens)
        table.release()
    assert all(n > 0 for n in seen.values()), seen  # the stress exercised every path
    assert pool.stats() == PoolStats(total=40, used=0, free=40, shared=0, published=0)
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
    assert sorted(pool.allocate(40)) == list(range(40))  # the free list holds every page exactly once


# -- copy-on-write -------------------------------------------------------------------------------------------

def test_writing_a_shared_page_never_changes_what_another_request_gathers():
    pool = _pool(10)
    a = PageTable(pool)
    a_tok = [1, 2, 3, 1, 2, 3]
    a.slots_for(6)
    _write(pool, a, a_tok, 0)
    key = _key(a_tok, 0, 4)
    assert pool.publish(key, a.pages[0]) == a.pages[0]
    b = PageTable(pool)  # shares A's full first page, then appends its own
    b.share(pool.lookup(key))
    b.slots_for(2)
    b_tok = a_tok[:4] + [0, 0]
    _write(pool, b, b_tok[4:], 4)
    assert pool.refcount(a.pages[0]) == 2 and pool.stats().shared == 1
    _write(pool, b, [3], 1)  # into the shared page: B gets a copy
    b_tok[1] = 3
    assert b.pages[0] != a.pages[0] and pool.refcount(a.pages[0]) == 1
    _check(pool, a, a_tok)
    _check(pool, b, b_tok)
    assert pool.lookup(key) == a.pages[0]  # A's page is unchanged and still published

    c = a.fork()  # shares A's partial last page; each append copies before writing
    last = a.pages[-1]
    c.slots_for(1)
    _write(pool, c, [0], 6)
    assert c.pages[-1] != last and pool.refcount(last) == 1
    a.slots_for(1)
    _write(pool, a, [2], 6)
    assert a.pages[-1] == last  # held alone by then: written in place
    _check(pool, a, a_tok + [2])
    _check(pool, c, a_tok + [0])

    b.release()
    c.release()
    page = a.pages[0]
    _write(pool, a, [0], 0)  # a published page written by its only holder leaves the index
    assert a.pages[0] == page and pool.lookup(key) is None
    a.release()
    assert pool.stats() == PoolStats(10, 0, 10, 0, 0)


def test_a_copy_that_does_not_fit_writes_nothing():
    pool = _pool(3)
    a = PageTable(pool)
    a.slots_for(4)
    _write(pool, a, [1, 1, 1, 1], 0)
    b = a.fork()
    filler = PageTable(pool)
    filler.slots_for(8)  # the last two pages
    with pytest.raises(PoolFull) as err:
        _write(pool, b, [2], 0)
    assert (err.value.asked, err.value.free) == (1, 0)
    assert b.pages == a.pages and pool.refcount(a.pages[0]) == 2
    _check(pool, a, [1, 1, 1, 1])
    _check(pool, b, [1, 1, 1, 1])
    for t in (a, b, filler):
        t.release()
    assert pool.stats().free == 3


# -- paged attention -----------------------------------------------------------------------------------------

def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Plain softmax(QK^T * scale) V in float64 over dense K, V (H_kv, T, D); q (H_q, 1, D) at position T - 1."""
    t, g = k.shape[1], q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)  # HF's repeat_kv
    s = q.double() @ k.transpose(1, 2) * scale  # (H_q, 1, T)
    allowed = attention.visible(torch.tensor([t - 1]), torch.arange(t), window)  # (1, T)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


TOL = {torch.float32: 1e-5, torch.float64: 1e-12}  # max abs difference against the float64 reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("page_tokens", [1, 3, 4, 16])
def test_paged_attention_matches_a_dense_float64_reference(page_tokens, gqa, dtype, monkeypatch):
    rng = random.Random(page_tokens * 10 + gqa)
    gen = torch.Generator().manual_seed(page_tokens * 10 + gqa)
    h_kv, d = 2, 8
    pool = _pool(70, layers=2, heads=h_kv, dim=d, page_tokens=page_tokens, dtype=dtype)
    scrambled = pool.allocate(pool.num_pages)
    rng.shuffle(scrambled)
    pool.release(scrambled)  # the free list, and so every table's pages, in random pool order
    monkeypatch.setattr(PagePool, "gather", lambda *a: pytest.fail("paged attention gathered the sequence"))
    max_t = min(70 * page_tokens, 60)
    lengths = sorted({1, page_tokens, page_tokens + 1, max_t, *(rng.randrange(1, max_t + 1) for _ in range(3))})
    out_of_order = False
    for t in lengths:
        table = PageTable(pool)
        dense = [(torch.randn(h_kv, t, d, generator=gen, dtype=dtype),
                  torch.randn(h_kv, t, d, generator=gen, dtype=dtype)) for _ in range(pool.num_layers)]
        start = 0
        while start < t:  # in random chunks, across page boundaries
            n = min(t - start, rng.randrange(1, 2 * page_tokens + 2))
            table.slots_for(n)
            for layer, (k, v) in enumerate(dense):
                pool.write(table, layer, k[:, start:start + n], v[:, start:start + n], start)
            start += n
        out_of_order |= table.pages != sorted(table.pages)
        for layer, (k, v) in enumerate(dense):
            for window in (None, 1, 5, page_tokens + 1, t, t + 3):
                scale = rng.choice((d ** -0.5, 4.0))  # 4.0: scores far apart, the running max matters
                q = torch.randn(h_kv * gqa, 1, d, generator=gen, dtype=dtype)
                out = paged_attention(q, pool, table, layer, scale=scale, window=window)
                assert out.shape == q.shape and out.dtype == dtype
                err = (out.double() - _dense(q, k, v, scale, window)).abs().max().item()
                assert err < TOL[dtype], (t, window, scale, err)
        table.release()
    assert out_of_order  # the tables really were scattered over the pool
    assert pool.stats().used == 0


# -- the pool full, publishing, bad arguments ------------------------------------------------------------------

def test_pool_full_takes_nothing():
    pool = _pool(5)
    a = PageTable(pool)
    a.slots_for(12)
    with pytest.raises(PoolFull) as err:
        pool.allocate(3)
    assert (err.value.asked, err.value.free) == (3, 2) and "3 pages asked, 2 free" in str(err.value)
    assert pool.free == 2
    b = PageTable(pool)
    b.slots_for(3)
    with pytest.raises(PoolFull):
        b.slots_for(6)  # 9 tokens: two more pages, one free
    assert (b.tokens, len(b.pages), pool.free) == (3, 1, 1)
    a.release()
    b.release()
    assert pool.stats() == PoolStats(5, 0, 5, 0, 0)


def test_byte_budget_sets_the_page_count():
    pool = PagePool(2, 3, 4, 5, byte_budget=960 * 7 + 959)  # a page: 2 (K, V) x 2 layers x 3 x 5 x 4 x 4 bytes
    assert (pool.page_bytes, pool.num_pages) == (960, 7)
    assert PagePool(2, 3, 4, 5, byte_budget=960, dtype=torch.bfloat16).num_pages == 2
    with pytest.raises(ValueError, match="byte_budget"):
        PagePool(2, 3, 4, 5, byte_budget=959)


def test_publishing_rules():
    pool = _pool(6)
    a, b = PageTable(pool), PageTable(pool)
    a.slots_for(5)
    _write(pool, a, [1] * 5, 0)
    with pytest.raises(ValueError, match="not full"):
        pool.publish("k", a.pages[1])
    b.slots_for(4)
    _write(pool, b, [1] * 4, 0, layers=1)
    with pytest.raises(ValueError, match="not full"):  # one layer written is not full
        pool.publish("k", b.pages[0])
    _write(pool, b, [1] * 4, 0)
    assert pool.publish("k", a.pages[0]) == a.pages[0]
    with pytest.raises(ValueError, match="published already"):
        pool.publish("other", a.pages[0])
    assert pool.publish("k", b.pages[0]) == a.pages[0]  # the first publisher keeps the key
    assert pool.stats().published == 1
    with pytest.raises(ValueError, match="mid-page"):
        a.share(b.pages[0])
    first = a.pages[0]
    a.release()
    assert pool.lookup("k") is None and pool.stats().published == 0  # a freed page leaves the index
    with pytest.raises(ValueError, match="free"):
        pool.publish("k", first)
    with pytest.raises(ValueError, match="not full"):
        PageTable(pool).share(first)
    b.release()


def test_counting_errors_change_nothing():
    pool = _pool(4)
    pages = pool.allocate(2)
    with pytest.raises(RuntimeError, match="released 2 times"):
        pool.release([pages[0], pages[1], pages[0]])
    assert [pool.refcount(p) for p in pages] == [1, 1]
    free = next(p for p in range(4) if p not in pages)
    with pytest.raises(RuntimeError, match="release"):
        pool.release([free])
    with pytest.raises(RuntimeError, match="retain"):
        pool.retain([pages[0], free])
    assert pool.refcount(pages[0]) == 1
    pool.release(pages)
    with pytest.raises(RuntimeError):
        pool.release(pages)
    assert pool.stats() == PoolStats(4, 0, 4, 0, 0)


BUDGET = 10 ** 6


@pytest.mark.parametrize(("call", "error", "name"), [
    (lambda: PagePool(0, 2, 3, 4, byte_budget=BUDGET), ValueError, "num_layers"),
    (lambda: PagePool(1, 2.0, 3, 4, byte_budget=BUDGET), TypeError, "kv_heads"),
    (lambda: PagePool(1, 2, True, 4, byte_budget=BUDGET), TypeError, "head_dim"),
    (lambda: PagePool(1, 2, 3, -4, byte_budget=BUDGET), ValueError, "page_tokens"),
    (lambda: PagePool(1, 2, 3, 4, byte_budget=-1), ValueError, "byte_budget"),
    (lambda: PagePool(1, 2, 3, 4, byte_budget=BUDGET, dtype=torch.int32), ValueError, "dtype"),
    (lambda: PagePool(1, 2, 3, 4, byte_budget=BUDGET, dtype="float32"), TypeError, "dtype"),
])
def test_bad_pool_arguments_are_named(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_bad_call_arguments_are_named():
    pool = _pool(8)
    table = PageTable(pool)
    table.slots_for(3)
    k, v = _content([1, 1], 0, 0, 2, 3)
    with pytest.raises(ValueError, match=r"\bn\b"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="n_new"):
        table.slots_for(-1)
    with pytest.raises(ValueError, match="pages"):
        pool.retain([8])
    with pytest.raises(ValueError, match="layer"):
        pool.write(table, 2, k, v, 0)
    with pytest.raises(ValueError, match="start"):
        pool.write(table, 0, k, v, 2)  # positions 2..3, only 3 reserved
    with pytest.raises(ValueError, match=r"\bk\b"):
        pool.write(table, 0, k[:1], v, 0)
    with pytest.raises(ValueError, match=r"\bv\b"):
        pool.write(table, 0, k, v.double(), 0)
    with pytest.raises(ValueError, match="table"):
        pool.write(PageTable(_pool(2)), 0, k, v, 0)
    with pytest.raises(TypeError, match="table"):
        pool.gather(object(), 0)  # type: ignore[arg-type]
    pool.write(table, 0, k, v, 0)
    q = torch.zeros(3, 1, 3)
    with pytest.raises(ValueError, match=r"\bq\b"):
        paged_attention(q, pool, table, 0, scale=1.0)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="window"):
        paged_attention(torch.zeros(4, 1, 3), pool, table, 0, scale=1.0, window=0)
    with pytest.raises(ValueError, match="table"):
        paged_attention(torch.zeros(4, 1, 3), pool, PageTable(pool), 0, scale=1.0)
    table.release()
    assert pool.stats().used == 0


def test_fill_writes_whole_pages_a_table_holds_alone():
    pool = PagePool(2, 2, 4, 3, byte_budget=2 * 2 * 2 * 3 * 4 * 4 * 6)
    a = PageTable(pool)
    a.slots_for(6)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    for layer in range(2):
        pool.fill(layer, a.pages, k, v)
    assert torch.equal(pool.gather(a, 1)[0], k.transpose(0, 1).reshape(2, 6, 4))
    key = ("page", 0)
    assert pool.publish(key, a.pages[0]) == a.pages[0]  # full in every layer: fill marks its slots written
    b = a.fork()
    with pytest.raises(RuntimeError, match="2 references"):
        pool.fill(0, b.pages[:1], k[:1], v[:1])
    with pytest.raises(ValueError, match="k must be"):
        pool.fill(0, [pool.allocate(1)[0]], k, v)
    b.release()
    a.release()

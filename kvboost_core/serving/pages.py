"""A paged KV pool shared across requests (issue #36): fixed-size pages of a preallocated pool, reference-counted,
found by content and copied on write, and decode attention that reads them page by page. The server's decode batch
runs over it with ``serve --kv-pool`` (:mod:`kvboost_core.serving.paged_batch`).

Layout: per layer, K and V are each one tensor of shape (num_pages, H_kv, page_tokens, D) (stored head-major). A
page is one index of the first dimension, in every layer at once: it holds ``page_tokens`` consecutive positions of
a request, all layers. A request's :class:`PageTable` lists its pages in position order; position p lives at
``(pages[p // page_tokens], p % page_tokens)``.

- Reference counts: :meth:`PagePool.allocate` hands out free pages at count 1, :meth:`~PagePool.retain` and
  :meth:`~PagePool.release` move the count, and a page whose count reaches 0 is free again (and leaves the
  content index). A request that leaves, is cancelled or fails calls :meth:`PageTable.release`.
- Content sharing: a full page (every slot written in every layer) may be published once under a hashable key
  chosen by the caller (a hash of the prefix chain of tokens, positions and precision: what makes two pages'
  contents equal); another request finds it with :meth:`~PagePool.lookup` and shares it
  (:meth:`PageTable.share`) instead of computing and storing it again.
- Copy-on-write: a page held by more than one table is never written. Writing into one first copies it (all
  layers) to a fresh page and swaps the writer's table entry, so the other holders never see the write. A
  published page written by its only holder leaves the index (its contents no longer match its key).
- Attention: :func:`paged_attention` is the torch path (online softmax page by page, any dtype, sliding windows);
  ``kvboost_core.kernels.ops.paged_decode_attention`` the native fp32 decode row over :meth:`PagePool.keys` /
  :meth:`PagePool.values` and a table's pages, bitwise the dense native kernel on the gathered rows.
- Not thread-safe: one thread (the scheduler's) owns a pool and its tables.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvboost_core.kernels import reference
from kvboost_core.model import attention


class PoolFull(Exception):
    """The pool has fewer free pages than an operation needs; nothing was allocated or written."""

    def __init__(self, asked: int, free: int) -> None:
        super().__init__(asked, free)
        self.asked = asked  # pages the operation needed
        self.free = free  # pages free when it was refused

    def __str__(self) -> str:
        return f"the page pool is full: {self.asked} pages asked, {self.free} free"


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int  # pages in the pool
    used: int  # pages with a count >= 1
    free: int  # total - used
    shared: int  # pages with a count >= 2 (held by several tables)
    published: int  # pages in the content index


def _count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: TypeError for a non-int (bools included), ValueError below it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class PagePool:
    """Per-layer K and V storage of shape (num_pages, kv_heads, page_tokens, head_dim), preallocated, with
    ``num_pages = byte_budget // page_bytes`` where ``page_bytes = 2 * num_layers * kv_heads * page_tokens *
    head_dim * dtype's item size`` (K and V of every layer). A budget that holds no page is a ValueError."""

    __slots__ = ("num_layers", "kv_heads", "head_dim", "page_tokens", "dtype", "device", "page_bytes",
                 "num_pages", "_k", "_v", "_refs", "_free", "_written", "_index", "_key_of")

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, page_tokens: int, *, byte_budget: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.num_layers = _count("num_layers", num_layers)
        self.kv_heads = _count("kv_heads", kv_heads)
        self.head_dim = _count("head_dim", head_dim)
        self.page_tokens = _count("page_tokens", page_tokens)
        _count("byte_budget", byte_budget, 0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self.dtype, self.device = dtype, torch.device(device)
        self.page_bytes = 2 * num_layers * kv_heads * page_tokens * head_dim * dtype.itemsize
        self.num_pages = byte_budget // self.page_bytes
        if self.num_pages < 1:
            raise ValueError(f"byte_budget={byte_budget} holds no page: one page is {self.page_bytes} bytes "
                             f"(2 x {num_layers} layers x {kv_heads} heads x {page_tokens} tokens x {head_dim} "
                             f"x {dtype.itemsize} bytes)")
        # Stored head-major, (kv_heads, num_pages, page_tokens, head_dim), and seen as (num_pages, kv_heads, ...):
        # a KV head's consecutive pages are then contiguous, and attention over a run of them reads about as fast as
        # over a dense sequence, where page-major storage is slower even in runs (benchmarks/bench_paged_attention.py,
        # rendered in docs/serving.md).
        # Empty, not zeros: nothing reads a slot before it is written (attention reads a table's first ``tokens``
        # positions, a shared page is full), and an untouched page costs no resident memory until first written.
        storage = (kv_heads, self.num_pages, page_tokens, head_dim)
        self._k = [torch.empty(storage, dtype=dtype, device=self.device).transpose(0, 1) for _ in range(num_layers)]
        self._v = [torch.empty(storage, dtype=dtype, device=self.device).transpose(0, 1) for _ in range(num_layers)]
        self._refs = [0] * self.num_pages
        self._free: deque[int] = deque(range(self.num_pages))
        self._written = torch.zeros(self.num_pages, num_layers, page_tokens, dtype=torch.bool)  # slots written
        self._index: dict[Hashable, int] = {}  # published key -> page
        self._key_of: dict[int, Hashable] = {}  # page -> its published key

    @property
    def free(self) -> int:
        return len(self._free)

    def keys(self, layer: int) -> torch.Tensor:
        """``layer``'s key storage, (num_pages, kv_heads, page_tokens, head_dim): what paged attention reads
        (``kvboost_core.kernels.ops.paged_decode_attention`` with a table's pages). Write through :meth:`write`."""
        return self._k[self._layer(layer)]

    def values(self, layer: int) -> torch.Tensor:
        """``layer``'s value storage, as :meth:`keys`."""
        return self._v[self._layer(layer)]

    def refcount(self, page: int) -> int:
        self._check_ids([page])
        return self._refs[page]

    def stats(self) -> PoolStats:
        used = sum(1 for r in self._refs if r)
        shared = sum(1 for r in self._refs if r > 1)
        return PoolStats(self.num_pages, used, self.num_pages - used, shared, len(self._index))

    # -- reference counts ------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages at count 1; PoolFull (nothing taken) when fewer are free."""
        _count("n", n, 0)
        if n > len(self._free):
            raise PoolFull(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more reference to each page (listed twice: two more). The pages must be in use."""
        pages = list(pages)
        self._check_ids(pages)
        for p in pages:
            if not self._refs[p]:
                raise RuntimeError(f"retain: page {p} is free (only a page in use can be shared)")
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One reference less to each page; a page at 0 is free again and leaves the index. Releasing a page
        more often than it is held is a RuntimeError, raised before any count changes."""
        pages = list(pages)
        self._check_ids(pages)
        for p, n in Counter(pages).items():
            if self._refs[p] < n:
                raise RuntimeError(f"release: page {p} has {self._refs[p]} references, released {n} times")
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                self._unpublish(p)
                self._written[p] = False
                self._free.append(p)

    # -- content index ---------------------------------------------------------------------------------------

    def lookup(self, key: Hashable) -> int | None:
        """The page published under ``key``, or None. Sharing it is the caller's (:meth:`PageTable.share`)."""
        return self._index.get(key)

    def publish(self, key: Hashable, page: int) -> int:
        """Publish a full page in use under ``key``; returns the page the key names: ``page``, or the page an
        earlier publisher holds under the same key (then ``page`` stays unpublished; the caller may share that
        one and release its own). A page is published at most once (ValueError)."""
        self._check_ids([page])
        if not self._refs[page]:
            raise ValueError(f"publish: page {page} is free")
        if page in self._key_of:
            raise ValueError(f"publish: page {page} is published already")
        if not self._full(page):
            raise ValueError(f"publish: page {page} is not full (every slot of every layer must be written)")
        held = self._index.setdefault(key, page)
        if held == page:
            self._key_of[page] = key
        return held

    # -- contents --------------------------------------------------------------------------------------------

    def write(self, table: PageTable, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k, v (H_kv, n, D) at the table's positions ``start .. start + n - 1`` of ``layer``; the room
        must be reserved (:meth:`PageTable.slots_for`). Pages held by other tables are copied first (PoolFull,
        nothing written, when the copies do not fit)."""
        self._own(table)
        layer = self._layer(layer)
        _count("start", start, 0)
        n = self._check_kv(k, v)
        if start + n > table.tokens:
            raise ValueError(f"start: positions {start}..{start + n - 1} are past the table's {table.tokens} "
                             "reserved tokens (reserve them with slots_for first)")
        if not n:
            return
        p_tok = self.page_tokens
        first, last = start // p_tok, (start + n - 1) // p_tok
        self._make_writable(table, range(first, last + 1))
        for i in range(first, last + 1):
            page, a, b = table.pages[i], max(start, i * p_tok), min(start + n, (i + 1) * p_tok)
            off = slice(a - i * p_tok, b - i * p_tok)
            self._k[layer][page, :, off] = k[:, a - start:b - start].detach()
            self._v[layer][page, :, off] = v[:, a - start:b - start].detach()
            self._written[page, layer, off] = True

    def fill(self, layer: int, pages: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole pages in one call: k, v (m, H_kv, page_tokens, D) into ``pages`` (m ids) of ``layer``.
        Each page must be in use by one table only (a fresh page of :meth:`PageTable.slots_for`; a shared page is
        never written: RuntimeError)."""
        layer = self._layer(layer)
        pages = list(pages)
        self._check_ids(pages)
        for p in pages:
            if self._refs[p] != 1:
                raise RuntimeError(f"fill: page {p} has {self._refs[p]} references (only a page one table holds "
                                   "alone may be written whole)")
        shape = (len(pages), self.kv_heads, self.page_tokens, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != self.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be {shape} of {self.dtype}, got {got}")
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        self._k[layer][idx] = k.detach()
        self._v[layer][idx] = v.detach()
        self._written[idx, layer] = True

    def gather(self, table: PageTable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's keys and values of ``layer`` as dense (H_kv, T, D) copies, T = table.tokens (reference and
        test use: attention reads pages directly, see :func:`paged_attention`)."""
        self._own(table)
        layer = self._layer(layer)
        idx = torch.tensor(table.pages, dtype=torch.long, device=self.device)
        return (reference.gather_pages(self._k[layer], idx, table.tokens),
                reference.gather_pages(self._v[layer], idx, table.tokens))

    # -- internals -------------------------------------------------------------------------------------------

    def _check_ids(self, pages: Sequence[int]) -> None:
        for p in pages:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise ValueError(f"pages: {p!r} is not a page of this pool (0..{self.num_pages - 1})")

    def _own(self, table: PageTable) -> None:
        if not isinstance(table, PageTable):
            raise TypeError(f"table must be a PageTable, got {type(table).__name__}")
        if table.pool is not self:
            raise ValueError("table: it belongs to another pool")

    def _layer(self, layer: int) -> int:
        _count("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be < {self.num_layers}, got {layer}")
        return layer

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """The number of tokens in k and v (H_kv, n, D) of the pool's dtype; ValueError naming the bad one."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[0] != self.kv_heads or t.shape[2] != self.head_dim:
                raise ValueError(f"{name} must be (H_kv={self.kv_heads}, n, D={self.head_dim}), got "
                                 f"{tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} is {t.dtype}; the pool stores {self.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"v's shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
        return int(k.shape[1])

    def _full(self, page: int) -> bool:
        return bool(self._written[page].all())

    def _unpublish(self, page: int) -> None:
        if page in self._key_of:
            del self._index[self._key_of.pop(page)]

    def _make_writable(self, table: PageTable, entries: Iterable[int]) -> None:
        """Make the table's pages at ``entries`` its own before a write: a page held by other tables is copied
        (all layers) to a fresh page that replaces it in the table; a published page held by this table alone
        leaves the index. PoolFull, nothing changed, when the copies do not fit."""
        entries = list(entries)
        shared = [i for i in entries if self._refs[table.pages[i]] > 1]
        if len(shared) > len(self._free):
            raise PoolFull(len(shared), len(self._free))
        for i in entries:
            old = table.pages[i]
            if self._refs[old] > 1:
                new = self.allocate(1)[0]
                for store in (*self._k, *self._v):
                    store[new].copy_(store[old])
                self._written[new] = self._written[old]
                self._refs[old] -= 1  # still held by the other tables
                table.pages[i] = new
            else:
                self._unpublish(old)


@dataclass(slots=True, eq=False)
class PageTable:
    """One request's pages in position order and its reserved length: positions ``[0, tokens)`` are reserved,
    and ``len(pages) == ceil(tokens / page_tokens)``. Build one empty (``PageTable(pool)``); it holds one
    reference to each of its pages until :meth:`release`."""

    pool: PagePool
    pages: list[int] = field(default_factory=list)
    tokens: int = 0

    def slots_for(self, n_new: int) -> list[tuple[int, int]]:
        """Reserve the next ``n_new`` positions; returns their (page, offset) in order. Allocates the pages they
        need and copies a shared last page they fall into (copy-on-write); PoolFull, table unchanged, when the
        pool cannot give them."""
        pool = self.pool
        _count("n_new", n_new, 0)
        p_tok = pool.page_tokens
        end = self.tokens + n_new
        grow = -(-end // p_tok) - len(self.pages)
        into_last = n_new > 0 and self.tokens % p_tok != 0  # the last page is partial and takes new slots
        copy = int(into_last and pool.refcount(self.pages[-1]) > 1)
        if grow + copy > pool.free:
            raise PoolFull(grow + copy, pool.free)
        if into_last:
            pool._make_writable(self, [len(self.pages) - 1])
        self.pages += pool.allocate(grow)
        slots = [(self.pages[p // p_tok], p % p_tok) for p in range(self.tokens, end)]
        self.tokens = end
        return slots

    def share(self, page: int) -> None:
        """Append a full page another table holds (one found by :meth:`PagePool.lookup`) as this table's next
        ``page_tokens`` positions; the table must end on a page boundary."""
        pool = self.pool
        if self.tokens % pool.page_tokens:
            raise ValueError(f"share: the table ends mid-page ({self.tokens} tokens); a shared page must start "
                             "a page of the table")
        pool._check_ids([page])
        if not pool._full(page):
            raise ValueError(f"share: page {page} is not full (or is free)")
        pool.retain([page])
        self.pages.append(page)
        self.tokens += pool.page_tokens

    def fork(self) -> PageTable:
        """A second table over the same pages (parallel sampling); writes by either copy what they change."""
        self.pool.retain(self.pages)
        return PageTable(self.pool, list(self.pages), self.tokens)

    def release(self) -> None:
        """Drop every page (the request ended, was cancelled or failed); the table is empty afterwards."""
        self.pool.release(self.pages)
        self.pages, self.tokens = [], 0


def paged_attention(q: torch.Tensor, pool: PagePool, table: PageTable, layer: int, *, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Decode attention of a request's last token over its pages: q (H_q, 1, D) at position T - 1 (T =
    ``table.tokens``) -> (H_q, 1, D). Reads K/V page by page from the pool (no dense copy of the sequence) and
    accumulates an online softmax (running max, sum and weighted values, rescaled per page) in float32 or
    finer. Grouped-query: query head h reads KV head ``h // (H_q // H_kv)`` (HF's ``repeat_kv``). ``window``:
    only the last ``window`` keys are visible (:func:`kvboost_core.model.attention.visible`)."""
    pool._own(table)
    layer = pool._layer(layer)
    h_kv, d = pool.kv_heads, pool.head_dim
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1] != 1 or q.shape[2] != d \
            or q.shape[0] % h_kv:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be (H_q, 1, D={d}) with H_q a multiple of H_kv={h_kv}, got {shape}")
    if window is not None:
        _count("window", window)
    t, p_tok = table.tokens, pool.page_tokens
    if t < 1:
        raise ValueError("table: it holds no tokens to attend")
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(h_kv, -1, d).to(acc_dtype) * scale  # (H_kv, G, D): a group's query heads share a KV head
    q_pos = torch.tensor([t - 1], device=pool.device)
    m = qg.new_full((*qg.shape[:2], 1), float("-inf"))  # (H_kv, G, 1) running max of the scores
    s_sum = qg.new_zeros((*qg.shape[:2], 1))  # (H_kv, G, 1) running sum of exp(score - m)
    acc = torch.zeros_like(qg)  # (H_kv, G, D) running sum of exp(score - m) * v
    first = (0 if window is None else max(0, t - window)) // p_tok  # the first page with a visible key
    base = first * p_tok
    allowed = attention.visible(q_pos, torch.arange(base, t, device=pool.device), window)  # (1, t - base)
    for i in range(first, (t - 1) // p_tok + 1):
        a, b = i * p_tok, min((i + 1) * p_tok, t)  # this page's positions [a, b): at least one visible
        k = pool._k[layer][table.pages[i], :, :b - a].to(acc_dtype)  # (H_kv, n, D)
        v = pool._v[layer][table.pages[i], :, :b - a].to(acc_dtype)
        s = (qg @ k.transpose(1, 2)).masked_fill(~allowed[:, a - base:b - base], float("-inf"))  # (H_kv, G, n)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        w = torch.exp(s - m_new)  # (H_kv, G, n)
        fix = torch.exp(m - m_new)  # rescales what earlier pages summed
        s_sum = s_sum * fix + w.sum(-1, keepdim=True)
        acc = acc * fix + w @ v
        m = m_new
    return (acc / s_sum).reshape(q.shape).to(q.dtype)

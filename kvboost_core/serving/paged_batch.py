"""Batched decode over a shared page pool (issue #36): :class:`BatchedDecoder`'s job with each request's KV held in
pages of one :class:`~kvboost_core.serving.pages.PagePool` instead of a dense row per request.

- **Pages with the same contents are held once.** A joining request's prompt KV is cut into pages of
  ``page_tokens`` positions. A full page is looked up in the pool's content index under a fingerprint of its
  contents (xxh3 of its keys in the first and last layers, the positions and the precision are in them); a
  candidate is shared only when every layer's K and V equal the request's bit for bit, so nothing is served
  unverified. Identical KV is what the same tokens at the same positions over the same prefix give (a system head,
  a chat's exact history, the same warmed documents laid out the same way); KV that a request's own repair changed
  differs and gets its own pages.
- **Attention reads the pages in place**: ``kvboost_core.kernels.ops.paged_decode_attention`` per row, through the
  row's page table; on the CPU at fp32 the native kernel, bitwise the dense native kernel on the same rows, so a
  paged batch decodes exactly as the dense :class:`BatchedDecoder` does with the native decode attention.
- **Admission counts pages.** :meth:`PagedBatchedDecoder.add` takes a request only when the pool can hold its
  prompt's new pages plus every admitted request's pages still to come (up to its capacity, prompt + max new
  tokens), so a decode step never runs out of pages; otherwise :class:`~kvboost_core.serving.pages.PoolFull`, and
  nothing was taken.
- Determinism as in :class:`BatchedDecoder`: row tiles for every linear layer, one attention call per row.
- Llama-shaped models only (the lean decode step, :mod:`kvboost_core.model.lean`); not thread-safe (the
  scheduler's thread owns it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvboost_core.kernels import ops
from kvboost_core.model.driver import ModelDriver
from kvboost_core.model.lean import lean_decoder
from kvboost_core.serving.batch import BatchSlot, DecodeBatch
from kvboost_core.serving.invariant import row_tiled
from kvboost_core.serving.pages import PagePool, PageTable, PoolFull, PoolStats

__all__ = ["PagedBatchedDecoder"]


def _pages_of(kv: torch.Tensor, pages: int, page_tokens: int) -> torch.Tensor:
    """A prefilled layer's K or V (1, H_kv, >=pages * page_tokens, D) as its first ``pages`` pages,
    (pages, H_kv, page_tokens, D) (a view)."""
    h, d = kv.shape[1], kv.shape[3]
    return kv[0, :, :pages * page_tokens].view(h, pages, page_tokens, d).transpose(0, 1)


class _PagedRows:
    """:class:`kvboost_core.model.lean.KVRows` over a pool: row r's new K/V go to ``slots[r]`` (page, offset), and
    it attends to its table's first ``positions[r] + 1`` positions."""

    __slots__ = ("pool", "_pages", "_offsets", "_tables", "_lengths")

    def __init__(self, pool: PagePool, tables: list[PageTable], slots: list[tuple[int, int]],
                 positions: list[int]) -> None:
        self.pool = pool
        self._pages = torch.tensor([p for p, _ in slots], device=pool.device)
        self._offsets = torch.tensor([o for _, o in slots], device=pool.device)
        self._tables = [torch.tensor(t.pages, dtype=torch.long, device=pool.device) for t in tables]
        self._lengths = [p + 1 for p in positions]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keys, values = self.pool.keys(layer), self.pool.values(layer)  # (N, H_kv, P, D)
        keys[self._pages, :, self._offsets] = k.to(keys.dtype)  # (n, H_kv, D) into (page_r, :, offset_r)
        values[self._pages, :, self._offsets] = v.to(values.dtype)

    def attend(self, layer: int, row: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        heads, hd = q.shape[1], q.shape[3]
        return ops.paged_decode_attention(q.reshape(heads, hd), self.pool.keys(layer), self.pool.values(layer),
                                          self._tables[row], self._lengths[row], scale)


class PagedBatchedDecoder(DecodeBatch):
    """Up to ``max_batch`` decoding requests over one page pool of ``pool_bytes`` (see the module docstring); the
    interface of :class:`~kvboost_core.serving.batch.BatchedDecoder`."""

    def __init__(self, driver: ModelDriver, max_batch: int, *, pool_bytes: int, page_tokens: int = 16,
                 deterministic: bool = True) -> None:
        lean = lean_decoder(driver) if driver.layerwise else None
        if lean is None:
            raise ValueError("a paged KV pool needs a Llama-shaped fp32 model that the lean decode step serves "
                             "(kvboost_core.model.lean); decode this model with the dense BatchedDecoder")
        super().__init__(driver, max_batch, deterministic)
        self.pool = PagePool(driver.num_layers, driver.num_kv_heads, driver.head_dim, page_tokens,
                             byte_budget=pool_bytes, dtype=driver.dtype, device=driver.device)
        self._lean = lean
        self._tables: dict[int, PageTable] = {}  # id(slot) -> its table

    # ------------------------------------------------------------------ membership
    @property
    def nbytes(self) -> int:
        """Bytes of the pool (preallocated, used or not)."""
        return self.pool.num_pages * self.pool.page_bytes

    def used_bytes(self) -> int:
        """Bytes of the pages in use (a page shared by several requests counts once)."""
        return self.pool.stats().used * self.pool.page_bytes

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def reserved_pages(self) -> int:
        """Pages the admitted requests may still take before reaching their capacity."""
        p_tok = self.pool.page_tokens
        return sum(-(-s.capacity // p_tok) - len(self._tables[id(s)].pages) for s in self._slots)

    @torch.inference_mode()
    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int, capacity: int) -> BatchSlot:
        """Hold a prefilled request's KV (per layer ``(1, H_kv, >=length, D)``) in pages, sharing the full pages
        whose contents the pool holds already. PoolFull (nothing taken) when the pool cannot also hold every
        admitted request's remaining pages."""
        if not self.free:
            raise RuntimeError("the batch is full; wait for a request to leave")
        if length < 1 or capacity < length:
            raise ValueError(f"need 1 <= length <= capacity, got length={length}, capacity={capacity}")
        p_tok = self.pool.page_tokens
        table = PageTable(self.pool)
        try:
            self._fill(table, keys, values, length)
            # this request's later pages and everyone else's must still fit: a step never runs out
            need = -(-capacity // p_tok) - len(table.pages) + self.reserved_pages()
            if need > self.pool.free:
                raise PoolFull(need, self.pool.free)
        except BaseException:
            table.release()
            raise
        slot = BatchSlot(len(self._slots), length, capacity)
        self._slots.append(slot)
        self._tables[id(slot)] = table
        return slot

    def remove(self, slot: BatchSlot, *, scrub: bool = False) -> None:
        """Release ``slot``'s pages (a page other requests hold stays). ``scrub`` is accepted for the dense
        decoder's interface: attention reads a table's own positions only, so nothing needs zeroing."""
        del scrub
        if not slot.active:
            return
        slot.active = False
        self._tables.pop(id(slot)).release()
        self._slots.remove(slot)
        for row, s in enumerate(self._slots):
            s.row = row

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state is unknown); their pages return to the pool."""
        for s in self._slots:
            s.active = False
            self._tables.pop(id(s)).release()
        self._slots = []

    def _fill(self, table: PageTable, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """The request's pages in position order: each full page the pool holds with the same contents is shared,
        the others are written, whole pages one call per layer."""
        pool, p_tok = self.pool, self.pool.page_tokens
        full = length // p_tok
        prints = [self._fingerprint(keys, i * p_tok, (i + 1) * p_tok) for i in range(full)]
        found = [pool.lookup(key) for key in prints]
        shared = self._verified(found, keys, values)  # page index -> pool page, where every layer is equal
        new: list[int] = []  # page indexes written (not shared), in order
        i = 0
        while i < full:
            if i in shared:
                table.share(shared[i])
                i += 1
                continue
            j = i
            while j < full and j not in shared:
                j += 1
            table.slots_for((j - i) * p_tok)  # one run of fresh pages
            new += range(i, j)
            i = j
        if new:
            ids = [table.pages[i] for i in new]
            idx = torch.tensor(new, device=pool.device)
            for layer in range(pool.num_layers):
                pool.fill(layer, ids, _pages_of(keys[layer], full, p_tok)[idx], _pages_of(values[layer], full, p_tok)[idx])
            for i in new:  # published under its fingerprint unless an earlier page holds that key
                if found[i] is None:
                    pool.publish(prints[i], table.pages[i])
        if length > full * p_tok:  # the partial last page: this request's own
            start = full * p_tok
            table.slots_for(length - start)
            for layer in range(pool.num_layers):
                pool.write(table, layer, keys[layer][0, :, start:length], values[layer][0, :, start:length], start)

    def _verified(self, found: list[int | None], keys: list[torch.Tensor], values: list[torch.Tensor]
                  ) -> dict[int, int]:
        """{page index: pool page} for the candidates whose K and V equal the request's in every layer."""
        cand = [i for i, page in enumerate(found) if page is not None]
        if not cand:
            return {}
        pool, p_tok = self.pool, self.pool.page_tokens
        full = len(found)
        idx = torch.tensor(cand, device=pool.device)
        pages = torch.tensor([found[i] for i in cand], device=pool.device)
        same = torch.ones(len(cand), dtype=torch.bool, device=pool.device)
        for layer in range(pool.num_layers):
            for held, mine in ((pool.keys(layer), keys[layer]), (pool.values(layer), values[layer])):
                same &= (held[pages] == _pages_of(mine, full, p_tok)[idx]).flatten(1).all(1)
        return {i: page for i, page, ok in zip(cand, pages.tolist(), same.tolist()) if ok}

    def _fingerprint(self, keys: list[torch.Tensor], start: int, end: int) -> tuple[Any, ...]:
        """A lookup key for the page at positions [start, end): xxh3 of its first and last layers' keys (the first
        fixes the tokens and positions, the last their context), with the shape and dtype. A hint only: a page is
        shared after :meth:`_verified` compares every layer."""
        import xxhash

        h = xxhash.xxh3_128()
        for layer in (0, len(keys) - 1):
            h.update(keys[layer][0, :, start:end].contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return ("kv-page", h.hexdigest(), end - start, str(keys[0].dtype))

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(self, tokens: dict[BatchSlot, int]) -> dict[BatchSlot, torch.Tensor]:
        """One token for every active slot (``tokens[slot]`` written at ``slot.length``); each slot's next-token
        logits (vocab,) in fp32."""
        self._check_step(tokens)
        tables = [self._tables[id(s)] for s in self._slots]
        written = [t.slots_for(1)[0] for t in tables]  # admission reserved these pages
        positions = [s.length for s in self._slots]
        rows = _PagedRows(self.pool, tables, written, positions)
        ids = torch.tensor([tokens[s] for s in self._slots], device=self.driver.device)
        with row_tiled(self._linears) if self.deterministic else contextlib.nullcontext():
            logits = self._lean.step_kv(ids, positions, rows).float()
        return self._advance(logits)

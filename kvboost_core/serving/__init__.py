"""Serving and its determinism: a prompt's output depends on the prompt and the warmed documents, never on the
requests served beside it or before it.

- :mod:`.batch`: batched decode over several requests' caches (continuous batching), and the server's prefill
  path; a row's logits do not depend on its neighbours;
- :mod:`.invariant`: the batch-invariant decode kernels that make that so (a row's result depends on the row
  alone);
- :mod:`.canonical`: the history-independent prefill, in canonical chunks planned from the prompt and the warmed
  documents alone;
- :mod:`.backfill`: exact history, a background job that recomputes a finished turn as a plain prefill would and
  stores it as exact prefix, so the next turn reads its whole history exactly;
- :mod:`.pages`: a paged KV pool: fixed-size pages of a preallocated pool sized from a byte budget,
  reference-counted, shared by content key and copied on write, with per-request page tables and decode attention
  that reads the pages directly (``paged_attention``; the native kernel is ``kernels.ops.paged_decode_attention``);
- :mod:`.paged_batch`: batched decode over that pool (``serve --kv-pool``): identical pages held once, admission
  counted in pages, outputs those of :mod:`.batch`'s dense rows.

Who drives them: the server (``kvboost_rag.app.server``) and the engine shell's chat turns
(:mod:`kvboost_core.engine.exact_history`); nothing else in kvboost_core imports this package.

Imports: :mod:`kvboost_core.model`, the cache pipeline and the shared values of kvboost_core (assembly, keys,
repair, results, segments, call_options, the store), and the engine only as :class:`kvboost_core.stages.EngineStages`;
never the engine shell (:mod:`kvboost_core.engine`), :mod:`kvboost_core.lora` or :mod:`kvboost_core.tuning`
(``tests/test_layout.py``).
"""

"""LoRA weights that change how a model reads reused KV, and the prefill they define.

- :mod:`.reader`: the reader adapter, a LoRA gated to the rows that read re-placed documents;
- :mod:`.block_adapter`: the block adapter, trained so a re-placed document *is* the adapted model's own
  prefill (Block-Attention style), and :mod:`.block_prefill` (that prefill, the independent reference
  construction), :mod:`.block_links` (link slots after each document, trained but not served yet);
- :mod:`.lora_file`: the one file format both kinds are saved in.

Imports: :mod:`kvboost_core.model` and the flat modules; never the engine shell (:mod:`kvboost_core.engine`),
:mod:`kvboost_core.serving` or :mod:`kvboost_core.tuning` (``tests/test_layout.py``).
"""

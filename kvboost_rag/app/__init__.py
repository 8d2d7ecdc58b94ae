"""The application layer above the :mod:`kvboost_rag` library: the ``kvboost-rag`` command line
(:mod:`.cli`), the demos (:mod:`.demo_chat` and its timing, :mod:`.demo_timing`; :mod:`.demo_data` and the
embedded demo model under ``assets/``),
the benchmarks (:mod:`.bench`) and the OpenAI-compatible server (:mod:`.server`).

Imports run one way: this layer may import the library, ``kvboost_core`` and the framework integrations
(``langchain_kvboost``, ``llama_index.llms.kvboost``); nothing in the library or in ``kvboost_core`` imports
this package (``tests/test_layout.py`` checks it). Importing it loads nothing.
"""

"""The benchmarks behind ``kvboost-rag bench``: :mod:`.ttft` (TTFT side by side, the entry point), :mod:`.rag`
(real-model RAG answers, ``bench rag``), :mod:`.quality` (answer quality beside the timings) and :mod:`.peer`
(the PyPI ``kvboost`` package run on the same prompts). Importing this package loads nothing."""

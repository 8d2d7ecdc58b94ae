"""Decode attention over a page pool against a dense cache (issue #36); a thin wrapper over
``kvboost_rag.app.bench.paged_attention``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_paged_attention.py --threads 1,2 --json benchmarks/results/paged_attention.json
"""

from kvboost_rag.app.bench.paged_attention import main

if __name__ == "__main__":
    raise SystemExit(main())

"""A request arriving while a chat's backfill runs (issue 33); a thin wrapper over
``kvboost_rag.app.bench.backfill_stall``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_backfill_stall.py --threads 1 \
        --json benchmarks/results/backfill_stall.json --plot benchmarks/results/backfill_stall.png
"""

from kvboost_rag.app.bench.backfill_stall import main

if __name__ == "__main__":
    raise SystemExit(main())

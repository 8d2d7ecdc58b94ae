"""Multi-turn RAG chat benchmark (issue #25); a thin wrapper over ``kvboost_rag.app.bench.multiturn``. Example:

    python benchmarks/bench_multiturn.py --threads 1 --json benchmarks/results/multiturn.json \
        --plot benchmarks/results/multiturn.png
"""

from kvboost_rag.app.bench.multiturn import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-turn RAG chat against llama.cpp (issue 33, item 5); a thin wrapper over
``kvboost_rag.app.bench.chat_turns``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_chat_turns.py --threads 1 --conversations 2 --turns 6 --k 8 \
        --json benchmarks/results/chat_turns.json --plot benchmarks/results/chat_turns.png
"""

from kvboost_rag.app.bench.chat_turns import main

if __name__ == "__main__":
    raise SystemExit(main())

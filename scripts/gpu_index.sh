#!/usr/bin/env bash
# The device tool carries the tracked tree plus at most 64 MiB a call. For the calls that carry a payload part
# (scripts/gpu_payload.sh), `trim` leaves out of the index (and excludes) what a GPU session does not read: the
# committed results, the docs' figures and the demo model's weights (about 21 MB), so a 52 MB part fits beside the
# rest (about 13 MB). A path under benchmarks/results a call needs then goes in the device tool's `carry`
# (e.g. benchmarks/results/block_scale_b_gpu for an arm's init). `restore` resets the index to HEAD and puts the
# excludes back (stage nothing else in between).
# Nothing is committed or deleted from the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
EXCL=.git/info/exclude
PATHS=(benchmarks/results docs/figures kvboost_rag/app/assets/demo_model/model.safetensors)
case "${1:-}" in
  trim)
    [ -f "$EXCL.gpu-bak" ] && { echo "already trimmed (restore first)" >&2; exit 1; }
    cp "$EXCL" "$EXCL.gpu-bak"
    for p in "${PATHS[@]}"; do echo "/$p" >> "$EXCL"; done
    git rm -r --cached -q "${PATHS[@]}"
    echo "tracked now: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
    ;;
  restore)
    git reset -q
    [ -f "$EXCL.gpu-bak" ] && mv "$EXCL.gpu-bak" "$EXCL"
    git status --short | head -5
    ;;
  *) echo "usage: scripts/gpu_index.sh trim|restore" >&2; exit 2 ;;
esac

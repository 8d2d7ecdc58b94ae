#!/usr/bin/env bash
# One prepared run on a lent GPU machine (CI has no GPU): everything that needs CUDA, in one command.
#   1. trains demo-model variants on the GPU (background, bf16 autocast, batches from worker processes);
#   2. builds the CUDA kernels (KVBOOST_CUDA=1) and runs the CUDA kernel tests and the engine-on-CUDA tests;
#   3. times workload A on the GPU at real scale (random-weight Qwen2.5-0.5B and -7B shapes, bf16).
# Usage: OUT=dir bash benchmarks/gpu_session.sh. Writes session.log, train_<v>.safetensors and artifacts.tar.gz
# under $OUT (few files: the device tool returns at most eight). Each stage is time-boxed; a failing stage is
# logged and the next one still runs. The optional peer (kvboost==0.9.0) is installed from .whl/ when present.
set -u
OUT=${OUT:-build/gpu_session}
PY=${PY:-python3}
TRAIN_MIN=${TRAIN_MIN:-4.5}
VARIANTS=${VARIANTS:-"a:4:3e-3 b:6:2e-3"}  # name:layers:peak-lr
WORKERS=${WORKERS:-6}  # batch-making processes per variant
BENCHES=${BENCHES:-"qwen2.5-0.5b:2,4,8:3:100 qwen2.5-7b:8,16,30:2:170"}  # shape:sizes:rounds:max-seconds
DEADLINE=${DEADLINE:-560}  # seconds from the start: later stages shrink or skip to end before it
DEVICE=${DEVICE:-cuda}  # cpu only for a dry run of this script
WORK=build/gpu_work
mkdir -p "$OUT" "$WORK"
ART="$WORK/artifacts"
mkdir -p "$ART"
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$LOG"; }

say "host: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" >>"$LOG" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# -- 1. demo-model variants, in the background --------------------------------------------------------------
pids=()
for v in $VARIANTS; do
  IFS=: read -r name layers lr <<<"$v"
  rm -rf "$WORK/train_$name" "$WORK/ckpt_$name"
  cp -r kvboost_rag/app/assets/demo_model "$WORK/train_$name"
  $PY scripts/train_demo_model.py --out "$WORK/train_$name" --ckpt-dir "$WORK/ckpt_$name" --keep-tokenizer \
    --no-eval --device "$DEVICE" --workers "$WORKERS" --batch 64 --layers "$layers" --lr "$lr" --minutes "$TRAIN_MIN" \
    --log-every 200 >"$ART/train_$name.log" 2>&1 &
  pids+=($!)
  say "training $name: $layers layers, lr $lr, $TRAIN_MIN min (pid $!)"
done

# -- 2. CUDA kernels and GPU tests ---------------------------------------------------------------------------
say "building kvboost_core._C with CUDA"
KVBOOST_CUDA=1 MAX_JOBS=6 timeout 420 $PY setup.py build_ext --inplace >"$ART/build.log" 2>&1
tail -5 "$ART/build.log" >>"$LOG"
$PY -c "from kvboost_core import kernels; print('kernels backend:', kernels.backend(), kernels.load_error() or '')" \
  >>"$LOG" 2>&1
say "GPU tests"
timeout 240 $PY -m pytest -q -ra -p no:cacheprovider tests/test_kernels.py tests/test_engine_cuda.py \
  >"$ART/pytest_gpu.log" 2>&1
say "pytest rc $?"
tail -25 "$ART/pytest_gpu.log" >>"$LOG"

# -- 3. wait for training, keep the weights ------------------------------------------------------------------
for p in "${pids[@]}"; do wait "$p"; done
for v in $VARIANTS; do
  name=${v%%:*}
  grep -E "^params|^saved" "$ART/train_$name.log" | tail -2 | sed "s/^/train $name: /" >>"$LOG"
  tail -3 "$ART/train_$name.log" | grep "^step" | sed "s/^/train $name: /" >>"$LOG"
  cp "$WORK/train_$name/model.safetensors" "$OUT/train_$name.safetensors" 2>>"$LOG"
  cp "$WORK/train_$name/config.json" "$ART/train_${name}_config.json" 2>>"$LOG"
  cp "$WORK/ckpt_$name/demo_model.train.json" "$ART/train_${name}_train.json" 2>>"$LOG"
done
say "training done"

# -- 4. workload A on the GPU ----------------------------------------------------------------------------------
common=(--chat-turns 0 --demo-questions 0 --stories none --device "$DEVICE")
for b in $BENCHES; do
  IFS=: read -r shape sizes rounds limit <<<"$b"
  left=$((DEADLINE - ($(date +%s) - t0) - 15))
  if ((left < 30)); then say "bench $shape skipped: ${left}s left before the deadline"; continue; fi
  ((limit > left)) && limit=$left
  say "bench $shape, sizes $sizes, $rounds rounds, at most ${limit}s"
  timeout "$limit" $PY -m kvboost_rag.app.bench.ttft --shape "$shape" --sizes "$sizes" --rounds "$rounds" "${common[@]}" \
    --json "$ART/ttft_gpu_$shape.json" --plot "$ART/ttft_gpu_$shape.png" >"$ART/bench_$shape.log" 2>&1
  say "bench rc $?"; grep -A9 " docs, " "$ART/bench_$shape.log" >>"$LOG"
done

tar czf "$OUT/artifacts.tar.gz" -C "$WORK" artifacts
say "done"

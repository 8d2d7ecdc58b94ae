#!/usr/bin/env bash
# One prepared run on a lent GPU machine (CI has no GPU): everything that needs CUDA, in one command.
#   0. block adapter arms (issue #32), when a payload is staged (scripts/gpu_payload.sh): SmolLM2 converted from
#      its GGUF and checked by fingerprint; with BLOCK_DATA, the teacher targets of that many chats computed here by
#      parallel workers; then one `adapt --block` run per arm on the GPU (background), each from the shipped
#      adapter (or its own init) over the teacher targets, for BLOCK_MIN wall-minutes, then scored on dev. A call
#      is at most 10 minutes: compute the targets in one call (BLOCK_ARMS="" KERNELS=0) and train in the next;
#      With RAG_EVAL="dev2:DIR", also `bench rag --device cuda` of that adapter on dev2, beside the arms;
#   1. trains demo-model variants on the GPU (background, bf16 autocast, batches from worker processes);
#   2. builds the CUDA kernels (KVBOOST_CUDA=1) and runs the CUDA kernel tests and the engine-on-CUDA tests;
#   3. times workload A on the GPU at real scale (random-weight Qwen2.5-0.5B and -7B shapes, bf16).
# Usage: OUT=dir bash benchmarks/gpu_session.sh. Writes session.log, the arms' block_<arm>.safetensors,
# train_<v>.safetensors and artifacts.tar.gz under $OUT (few files: the device tool returns at most eight). Each
# stage is time-boxed; a failing stage is logged and the next one still runs. The optional peer (kvboost==0.9.0)
# is installed from .whl/ when present.
set -u
OUT=${OUT:-build/gpu_session}
PY=${PY:-python3}
TRAIN_MIN=${TRAIN_MIN:-4.5}
VARIANTS=${VARIANTS-"a:4:3e-3 b:6:2e-3"}  # name:layers:peak-lr
WORKERS=${WORKERS:-6}  # batch-making processes per variant
BENCHES=${BENCHES-"qwen2.5-0.5b:2,4,8:3:100 qwen2.5-7b:8,16,30:2:170"}  # shape:sizes:rounds:max-seconds
DEADLINE=${DEADLINE:-560}  # seconds from the start: later stages shrink or skip to end before it
DEVICE=${DEVICE:-cuda}  # cpu only for a dry run of this script
STAGE=${STAGE:-/tmp/kvb_stage}  # where scripts/gpu_payload.sh's parts were copied (p0, p1, ...); none: no arms
# arms trained side by side: recipe[:init] (kvboost_rag.app.distill.RECIPES; init: an adapter directory to start from,
# default the shipped one, which is scale_b_gpu). Default: recipe e (the full-attention term) against its control b
BLOCK_ARMS=${BLOCK_ARMS-"b e"}
BLOCK_MIN=${BLOCK_MIN:-5}  # wall-minutes of training per arm (the schedule decays over them)
BLOCK_ARGS=${BLOCK_ARGS:-"--lr 3e-4 --eval --dev-limit 64"}
BLOCK_CHATS=${BLOCK_CHATS:-768}  # training chats of the staged data/ (BLOCK_DATA's when that is set)
BLOCK_DATA=${BLOCK_DATA:-}  # N: compute the teacher targets of N training chats here (DATA_WORKERS processes side by
# side, resumable: a second call finds the shards done), and train the arms on them instead of the staged data/
DATA_WORKERS=${DATA_WORKERS:-12}
DATA_S=${DATA_S:-240}  # at most this long for the targets; the arms wait for them
KERNELS=${KERNELS:-1}  # 0: skip stage 2
RAG_EVAL=${RAG_EVAL:-}  # "split:adapter_dir ...": bench rag of each adapter on that split (dev2: 768 questions) on the
# GPU, every arm (base and adapted full prefill, block reuse checked against the independent construction), in the
# background beside the arms; its JSON is kept under artifacts/ (issue #32's dev2 reading, CPU-hours here)
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

# -- 0. block adapter arms, in the background ------------------------------------------------------------------
arms=()
if ls "$STAGE"/p[0-9] >/dev/null 2>&1 && [ -n "$BLOCK_ARMS$BLOCK_DATA$RAG_EVAL" ]; then
  if [ ! -d "$STAGE/site" ]; then  # (a second call on the same warm machine finds it unpacked)
    say "unpacking the payload ($(cat "$STAGE"/p[0-9] | wc -c) bytes in $(ls "$STAGE"/p[0-9] | wc -l) parts)"
    cat "$STAGE"/p[0-9] | $PY -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')" "$STAGE" 2>>"$LOG" \
      || say "payload unpack failed"
  fi
  # the payload's transformers (the version this package is tested with) and a package folder that holds the GGUF
  export PYTHONPATH="$STAGE/site:$STAGE/pkgs${PYTHONPATH:+:$PYTHONPATH}" KVBOOST_CACHE_DIR="$STAGE/cache"
  if $PY -c "
import sys
from kvboost_core import zoo
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers
folder = zoo.resolve('smollm2-135m-instruct')
m = AutoModelForCausalLM.from_pretrained(folder); t = AutoTokenizer.from_pretrained(folder)
ok = zoo.recognise(m, t) is not None
print('transformers', transformers.__version__, 'converted', folder, 'fingerprint', 'ok' if ok else 'MISMATCH')
sys.exit(0 if ok else 1)" >>"$LOG" 2>&1; then
    data="$STAGE/data"
    if [ -n "$BLOCK_DATA" ]; then
      data="$STAGE/gen"
      say "teacher targets of $BLOCK_DATA chats: $DATA_WORKERS workers, at most ${DATA_S}s"
      workers=()
      for ((w = 0; w < DATA_WORKERS; w++)); do
        OMP_NUM_THREADS=1 timeout "$DATA_S" $PY -m kvboost_rag.app.adapt_block --block --out "$WORK/data_w$w" \
          --data "$data" --chats "$BLOCK_DATA" --data-only --data-worker "$w/$DATA_WORKERS" --device "$DEVICE" \
          >"$ART/data_w$w.log" 2>&1 &
        workers+=($!)
      done
      # and the dev targets the arms are scored on (--eval-only --data-only: those alone)
      OMP_NUM_THREADS=1 timeout "$DATA_S" $PY -m kvboost_rag.app.adapt_block --block --out "$WORK/data_dev" \
        --data "$data" --data-only --eval-only --dev-limit 64 --device "$DEVICE" >"$ART/data_dev.log" 2>&1 &
      workers+=($!)
      for p in "${workers[@]}"; do wait "$p"; done
      # the arms train on the complete shards before the first gap (a worker stopped at DATA_S leaves gaps)
      BLOCK_DATA=$($PY -c "import os, sys
from kvboost_rag.app import distill
i = 0
while os.path.isfile(distill.shard_path(sys.argv[1], i)):
    i += 1
print(min(int(sys.argv[2]), i * distill.SHARD))" "$data/train" "$BLOCK_DATA")
      say "teacher targets: $(ls "$data"/train/targets-*.pt 2>/dev/null | wc -l) shards, the arms train on $BLOCK_DATA chats"
    fi
    for spec in $RAG_EVAL; do
      split=${spec%%:*}
      adir=${spec#*:}
      name=$(basename "$adir")
      OMP_NUM_THREADS=2 timeout $((DEADLINE - 30)) $PY -m kvboost_rag.app.cli bench rag --device "$DEVICE" \
        --split "$split" --k 12 --max-new-tokens 16 --settings "" --block-adapter "$adir" --adapted-full --cache-bytes 6GiB \
        --json "$ART/rag_${split}_$name.json" >"$ART/rag_${split}_$name.log" 2>&1 &
      arms+=($!)
      say "bench rag on $split with $name on $DEVICE (pid $!)"
    done
    for spec in $BLOCK_ARMS; do
      arm=${spec%%:*}
      init=kvboost_core/zoo_data/smollm2-135m-instruct-block
      [ "$spec" != "$arm" ] && init=${spec#*:}
      OMP_NUM_THREADS=2 $PY -m kvboost_rag.app.adapt_block --block --out "$WORK/block_$arm" --data "$data" \
        --recipe "$arm" --chats "${BLOCK_DATA:-$BLOCK_CHATS}" --steps 1000000 --wall-minutes "$BLOCK_MIN" --device "$DEVICE" \
        --init "$init" $BLOCK_ARGS >"$ART/block_$arm.log" 2>&1 &
      arms+=($!)
      say "block arm $arm from $init: $BLOCK_MIN wall-min on $DEVICE (pid $!)"
    done
  else
    say "the staged model is not SmolLM2's exact weights (fingerprint): no block arms"
  fi
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
if [ "$KERNELS" = 1 ]; then
say "building kvboost_core._C with CUDA"
KVBOOST_CUDA=1 MAX_JOBS=8 timeout "${BUILD_S:-300}" $PY setup.py build_ext --inplace >"$ART/build.log" 2>&1
tail -5 "$ART/build.log" >>"$LOG"
$PY -c "from kvboost_core import kernels; print('kernels backend:', kernels.backend(), kernels.load_error() or '')" \
  >>"$LOG" 2>&1
say "GPU tests"
# Argument errors raised through the native ops run in a process of their own, after the rest: on the first lent
# image the first such raise crashed the process (SIGSEGV), and that must not cost the engine-on-CUDA tests.
RAISING="rejects_bad_arguments or errors_match or errors_keep or cuda_bad_arguments"
timeout "${TESTS_S:-150}" $PY -m pytest -q -ra -p no:cacheprovider tests/test_kernels.py tests/test_engine_cuda.py \
  tests/test_paged_decode_attention.py -k "not ($RAISING)" >"$ART/pytest_gpu.log" 2>&1
say "pytest rc $?"
tail -25 "$ART/pytest_gpu.log" >>"$LOG"
timeout 60 $PY -m pytest -q -ra -p no:cacheprovider tests/test_kernels.py tests/test_paged_decode_attention.py \
  -k "$RAISING" >"$ART/pytest_raise.log" 2>&1
rc=$?
say "pytest (argument errors through the native ops) rc $rc"
tail -5 "$ART/pytest_raise.log" >>"$LOG"
if ((rc != 0)); then
  say "diagnosing the native ops' error path"
  KVBOOST_PY=$PY timeout 120 bash scripts/diag_native_raise.sh >"$ART/diag_raise.log" 2>&1
  tail -40 "$ART/diag_raise.log" >>"$LOG"
fi
fi

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

# the arms save their adapter before scoring it: at the deadline a still-running arm is stopped, its adapter kept
alive() { for p in "${arms[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
while (($(date +%s) - t0 < DEADLINE - 20)) && alive; do sleep 5; done
for p in "${arms[@]}"; do kill -0 "$p" 2>/dev/null && { say "stopping arm pid $p at the deadline"; kill "$p"; }; done
for spec in $BLOCK_ARMS; do
  arm=${spec%%:*}
  [ -f "$WORK/block_$arm/block.safetensors" ] || continue
  cp "$WORK/block_$arm/block.safetensors" "$OUT/block_$arm.safetensors"
  cp "$WORK/block_$arm/block.json" "$ART/block_$arm.json"
  cp "$WORK/block_$arm/links.safetensors" "$ART/block_${arm}_links.safetensors" 2>/dev/null
  grep -E "reached|saved to|\"acc\"|answer_kl|diff" "$ART/block_$arm.log" | sed "s/^/block $arm: /" >>"$LOG"
done
((${#arms[@]})) && say "block arms done"

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

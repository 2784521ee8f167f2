#!/usr/bin/env bash
# Runs kpt's GPU tests and the side-by-side benchmark from a bundle made by
# `cargo xtask gpu-bundle`. Needs only the NVIDIA driver, cuBLASLt and (for the
# benchmark) a python3 with CUDA PyTorch.
#
#   run.sh OUT_DIR [all|tests|bench|models|xla|profile] [extra kpt-bench-cuda arguments...]
#   run.sh OUT_DIR ab VAR FILTER [ROUNDS]
#   run.sh OUT_DIR ab-bundle OTHER_BUNDLE FILTER [ROUNDS]
#
# `ab`: an A/B of one of kpt's runtime switches (an environment variable such as
# KPT_CUDA_KV_MULTICAST): the attention cases matching FILTER (kpt-bench-cuda --filter)
# with VAR=0 and VAR=1 in turn, ROUNDS rounds (2 by default), against torch's cuDNN backend
# alone; the reports go to OUT_DIR/reports as attention-GPU-VAR{0,1}-r{ROUND}.
#
# `ab-bundle`: the same A/B between two builds: OTHER_BUNDLE (the folder of another
# bundle, e.g. one of the commit before) and this one, in turn; the reports are named
# attention-GPU-{other,this}-r{ROUND}.
#
# `profile`: Nsight Compute (ncu, --set full, clocks left alone) on one launch of kpt's
# attention kernel and one of cuDNN's (torch SDPA) at the issue's d64 and d128 shapes;
# the reports, their details pages, raw metrics and per-instruction samples (CSV) go to
# OUT_DIR/profile.
#
# `xla`: kpt-tpu's tests (xla-tests/) on the CUDA PJRT plugin of the machine's JAX, then
# kpt-bench-xla (kpt-tpu vs JAX jit) on the 1.1B checkpoint of `models` (written first
# when it is not there).
#
# Test logs, `kpt detect --json`, the logs of `kpt --device cuda validate|demo|bench`
# and the report go to OUT_DIR; the exit status is
# non-zero if any test or the benchmark failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUT_DIR [all|tests|bench]}"
what="${2:-all}"
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"

# cudarc looks for libcublasLt.so (or .so.12); CUDA 13 installs .so.13. Point a private
# libcublasLt.so at the first one found.
libdir="$here/lib"
mkdir -p "$libdir"
if [ ! -e "$libdir/libcublasLt.so" ]; then
  found="$({
    ldconfig -p 2>/dev/null | awk '/libcublasLt\.so/ {print $NF}'
    ls /usr/local/cuda*/lib64/libcublasLt.so* 2>/dev/null
    python3 - <<'PY' 2>/dev/null
import glob, os, nvidia
for p in nvidia.__path__:
    for f in sorted(glob.glob(os.path.join(p, "**", "libcublasLt.so*"), recursive=True)):
        print(f)
PY
  } | head -n 1)"
  if [ -n "$found" ]; then
    ln -sf "$found" "$libdir/libcublasLt.so"
    echo "cuBLASLt: $found"
  else
    echo "cuBLASLt: not found (GEMM tests will fail)"
  fi
fi
export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
export KPT_REQUIRE_GPU=1
# kpt-nvidia's torch_oracle test: attention against torch's SDPA on the same inputs.
export KPT_REQUIRE_TORCH=1 KPT_TORCH_PYTHON=python3
export KPT_TORCH_ORACLE_SCRIPT="$here/torch_attention_oracle.py"
# kpt's hf_oracle test: every model architecture against HF transformers.
export KPT_HF_MODELS_SCRIPT="$here/hf_models.py"
KPT_GIT_COMMIT="$(cat "$here/GIT_COMMIT")"
export KPT_GIT_COMMIT

# Reports are named after the GPU (nvidia-h100, attention-h200, ...).
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
  grep -oiE '[ABHL][0-9]{2,3}' | head -n 1 | tr '[:upper:]' '[:lower:]')"
gpu="${gpu:-gpu}"
echo "reports named after: $gpu"

status=0
# kpt-bench-cuda's attention suite with the arguments given, timing the registry's kernel
# only (the general fallback kernel takes seconds a call at these sizes; it is still
# checked against the reference). The profile mode spells it out: ncu runs the binary.
# `bench_bin` is the kpt-bench-cuda that runs it (this bundle's unless set).
attention_bench() {
  "${bench_bin:-$here/bin/kpt-bench-cuda}" --python python3 --script "$here/torch_cuda.py" \
    --suite attention --chosen-only "$@"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$here/bin/kpt" detect --json > "$out/detect.json" 2> "$out/detect.log" || status=1
  cat "$out/detect.json"
  # The CLI end to end on the GPU: validate every op of the demo model against the f64
  # reference, generate with the demo model, time single ops.
  for cmd in "validate" "demo --tokens 16 --profile" "bench --quick --profile"; do
    log="$out/kpt-${cmd%% *}.log"
    if "$here/bin/kpt" --device cuda $cmd > "$log" 2>&1; then
      echo "PASS kpt --device cuda $cmd"
      tail -n 25 "$log"
    else
      status=1
      echo "FAIL kpt --device cuda $cmd"
      tail -n 40 "$log"
    fi
  done
  # Every test twice: with the cubins, and with KPT_CUDA_JIT=1 on the PTX alone (the
  # path of a GPU newer than every cubin, and of drivers that refuse a cubin).
  for jit in 0 1; do
    for t in "$here"/tests/*; do
      name="$(basename "$t")"
      [ "$jit" = 1 ] && name="$name-jit"
      if KPT_CUDA_JIT=$jit "$t" --test-threads=1 > "$out/$name.log" 2>&1; then
        echo "PASS $name: $(grep -E '^test result' "$out/$name.log" | tail -n 1)"
      else
        status=1
        echo "FAIL $name"
        grep -E "panicked|FAILED|failed" "$out/$name.log" | head -n 40
      fi
    done
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$here/bin/kpt-bench-cuda" --python python3 --script "$here/torch_cuda.py" \
    --name "nvidia-$gpu" --out "$out/reports" "$@" || status=1
  attention_bench --name "attention-$gpu" --out "$out/reports" "$@" || status=1
  # Host time per decode-shaped run with CUDA graphs off and on.
  mkdir -p "$out/reports"
  "$here/bin/kpt-bench-graphs" --out "$out/reports/graphs-$gpu.json" || status=1
fi
if [ "$what" = models ] || [ "$what" = all ]; then
  # A 1.1B LLaMA-shaped checkpoint through kpt-models and HF transformers.
  "$here/bin/kpt-bench-models" --python python3 --script "$here/hf_models.py" \
    --dir "${TMPDIR:-/tmp}/kpt-bench-llama" --name "models-$gpu" --out "$out/reports" || status=1
fi
# One side of an A/B round (`ab`, `ab-bundle`): the attention cases matching $filter
# against torch's cuDNN backend alone, as report attention-GPU-NAME-rROUND, logged to
# OUT_DIR/ab-NAME-rROUND.log; prints the result lines, fails with the benchmark.
ab_side() {
  local name="$1" round="$2" rc=0
  attention_bench --sdpa cudnn --filter "$filter" --name "attention-$gpu-$name-r$round" \
    --out "$out/reports" > "$out/ab-$name-r$round.log" 2>&1 || rc=1
  grep -E '^attention' "$out/ab-$name-r$round.log"
  return $rc
}
if [ "$what" = ab ]; then
  var="${1:?usage: run.sh OUT_DIR ab VAR FILTER [ROUNDS]}"
  filter="${2:?usage: run.sh OUT_DIR ab VAR FILTER [ROUNDS]}"
  rounds="${3:-2}"
  for round in $(seq 1 "$rounds"); do
    for value in 0 1; do
      echo "$var=$value round $round:"
      (export "$var=$value"; ab_side "$var$value" "$round") || status=1
    done
  done
fi
if [ "$what" = ab-bundle ]; then
  other="${1:?usage: run.sh OUT_DIR ab-bundle OTHER_BUNDLE FILTER [ROUNDS]}"
  filter="${2:?usage: run.sh OUT_DIR ab-bundle OTHER_BUNDLE FILTER [ROUNDS]}"
  rounds="${3:-2}"
  for round in $(seq 1 "$rounds"); do
    for side in other this; do
      bundle="$here"
      [ "$side" = other ] && bundle="$other"
      echo "$side ($(cat "$bundle/GIT_COMMIT" 2>/dev/null)) round $round:"
      (bench_bin="$bundle/bin/kpt-bench-cuda"; ab_side "$side" "$round") || status=1
    done
  done
fi
if [ "$what" = profile ]; then
  mkdir -p "$out/profile"
  # name, kernel-name regex, then the command; the fourth matching launch is profiled.
  profile() {
    local name="$1" kernel="$2"
    shift 2
    if ncu --clock-control none --set full --import-source no -k "regex:$kernel" \
        --launch-skip 3 -c 1 --target-processes all -f -o "$out/profile/$name" "$@" \
        > "$out/profile/$name.log" 2>&1; then
      ncu -i "$out/profile/$name.ncu-rep" --page details > "$out/profile/$name.details.txt"
      ncu -i "$out/profile/$name.ncu-rep" --page raw --csv > "$out/profile/$name.raw.csv"
      ncu -i "$out/profile/$name.ncu-rep" --page source --csv --print-source sass \
        > "$out/profile/$name.sass.csv"
      echo "PASS profile $name: $(grep -m1 -E '^ +Duration' "$out/profile/$name.details.txt")"
    else
      status=1
      echo "FAIL profile $name (see $out/profile/$name.log)"
    fi
  }
  for shape in "16 16 1024 64" "8 16 2048 128"; do
    read -r b h s d <<< "$shape"
    profile "cudnn-d$d" "sdpa|fmha|fprop" python3 "$here/sdpa_cudnn.py" "$b" "$h" "$s" "$d" full
    profile "kpt-d$d" "kpt_flash_attention_sm90" "$here/bin/kpt-bench-cuda" --python python3 \
      --script "$here/torch_cuda.py" --suite attention --chosen-only \
      --filter "attention_prefill_bf16_b${b}_h${h}_s${s}_d${d}_full\$" \
      --name profile --out "$out/profile/bench-d$d"
  done
fi
if [ "$what" = xla ]; then
  plugin="$(python3 - <<'PY'
import glob, os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in sorted(glob.glob(os.path.join(d, "jax_plugins", "xla_cuda*", "*.so"))):
        print(f)
        sys.exit(0)
PY
)"
  if [ -z "$plugin" ]; then
    echo "FAIL xla: no JAX CUDA PJRT plugin in python3's site-packages"
    exit 1
  fi
  echo "PJRT plugin: $plugin"
  for t in "$here"/xla-tests/*; do
    name="$(basename "$t")"
    if KPT_PJRT_PLUGIN="$plugin" KPT_REQUIRE_PJRT=1 PROPTEST_CASES="${PROPTEST_CASES:-3}" \
        "$t" --test-threads=1 > "$out/xla-$name.log" 2>&1; then
      echo "PASS xla $name: $(grep -E '^test result' "$out/xla-$name.log" | tail -n 1)"
    else
      status=1
      echo "FAIL xla $name"
      grep -E "panicked|FAILED|Test failed" "$out/xla-$name.log" | head -n 20
    fi
  done
  ckpt="${TMPDIR:-/tmp}/kpt-bench-llama"
  if [ ! -f "$ckpt/config.json" ]; then
    "$here/bin/kpt-bench-models" --python python3 --script "$here/hf_models.py" \
      --dir "$ckpt" --checkpoint-only || status=1
  fi
  "$here/bin/kpt-bench-xla" --plugin "$plugin" --python python3 \
    --script "$here/jax_llama.py" --dir "$ckpt" --seq 2048 --dtype bf16 \
    --name tpu-xla --out "$out/reports" --command "gpu-bundle run.sh xla" "$@" || status=1
fi
exit $status

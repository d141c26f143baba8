#!/usr/bin/env bash
# One device call: cold JIT build (in the background, timed), the GPU tests on the prebuilt
# module, then the kernel benchmark. Logs go to $OUT. Needs .devshare/ carried:
#   .devshare/fixtures/exl3 (copy of shared/fixtures/exl3: reference + the three models)
#   .devshare/prebuilt      (python -m engine build-ext --arch 9.0 --export .devshare/prebuilt)
# Usage: bash ext/device_check.sh [pytest -k expression] [bench args...]
set -u
OUT=${OUT:-/tmp/trellis_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRELLIS_SHARED=$PWD/.devshare
KEXPR=${1:-}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# Cold JIT build with 16 cores, its own empty cache: the number the issue asks for.
(
  start=$SECONDS
  TRELLIS_EXT_CACHE=/tmp/trellis_jit python3 -m engine.commands.build_ext --force >"$OUT/jit_build.log" 2>&1
  echo "rc=$? wall_s=$((SECONDS - start))" >>"$OUT/jit_build.log"
) &
build_pid=$!

export TRELLIS_EXT_PREBUILT=$PWD/.devshare/prebuilt
if [ -n "$KEXPR" ]; then
  timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/cuda tests/quant -k "$KEXPR" 2>&1 | tee "$OUT/tests.log" | tail -25
else
  timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/cuda tests/quant 2>&1 | tee "$OUT/tests.log" | tail -25
fi
wait $build_pid
tail -4 "$OUT/jit_build.log"
timeout 240 python3 -m engine.commands.bench_kernels --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"

#!/usr/bin/env bash
# One device call: cold JIT build (timed), the GPU tests, then the kernel benchmark. Logs go to
# $OUT. Needs .devshare/fixtures/exl3 carried (a copy of shared/fixtures/exl3: reference + the
# three models). If .devshare/prebuilt holds a module built here for the same sources
# (python -m engine build-ext --arch 9.0 --export .devshare/prebuilt), the tests use it.
# Usage: bash tools/device_check.sh [pytest -k expression] [bench args...]
set -u
OUT=${OUT:-/tmp/trellis_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRELLIS_SHARED=$PWD/.devshare TRELLIS_EXT_CACHE=/tmp/trellis_jit
KEXPR=${1:-}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# Cold JIT build with the machine's cores and an empty cache: the number the issue asks for.
start=$SECONDS
python3 -m engine.commands.build_ext --force 2>&1 | tee "$OUT/jit_build.log"
echo "rc=${PIPESTATUS[0]} wall_s=$((SECONDS - start))" | tee -a "$OUT/jit_build.log"

if [ -n "$KEXPR" ]; then
  timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/cuda tests/exl3 tests/convert -k "$KEXPR" 2>&1 | tee "$OUT/tests.log" | tail -25
else
  timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/cuda tests/exl3 tests/convert 2>&1 | tee "$OUT/tests.log" | tail -25
fi
timeout 200 python3 -m engine.bench.kernels --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
# Memory checker on a few launches of each codebook (the default and the workspace GEMV): no out-of-bounds access.
if command -v compute-sanitizer >/dev/null; then
  for cb in mcg mul1; do
    timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 tools/profile_gemv.py 1024 384 3 5 $cb 2>&1 | tail -2
    timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 tools/profile_gemv.py 2048 256 7 8 $cb workspace 2>&1 | tail -2
  done | tee "$OUT/memcheck.log"
fi
# Hardware counters for one launch: where the warps stall.
if command -v ncu >/dev/null; then
  timeout 90 ncu --clock-control none --kernel-name regex:exl3_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 tools/profile_gemv.py 4096 14336 4 1 mcg > "$OUT/ncu.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Achieved Occupancy|Eligible|Registers|Block Limit" "$OUT/ncu.txt" | head -40
fi

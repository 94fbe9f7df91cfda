#!/usr/bin/env bash
# The GPU checks of issue #25 in one call on a lent GPU machine (Python 3.12, torch with CUDA, no Ray,
# no internet), from the repository root, with .whl/ carried (benchmarks/gpu_wheels.py builds it):
#
#   bash benchmarks/gpu_run.sh            # everything under $OUT (default ./gpu_out): at most 7 files
#
# 1. installs the wheels into /tmp/site (Ray 2.60 slimmed, its missing dependencies, isal);
# 2. tests/test_slots.py's CUDA test (the DMA into the pinned slot), its log;
# 3. benchmarks/gpu_snapshot.py (phase 1 on the device, against a plain .cpu()), its output;
# 4. benchmarks/gpu_e2e.py (TorchTrainer on the GPU: overhead at k=1 and k=10 against DCP and Ray
#    ASYNC, SIGKILL restored bitwise), its JSON, table and logs.
# Each step has its own time limit and its own files; a step that fails or times out does not stop the
# others. Set GPU_E2E_BUDGET_S (default 270) to give gpu_e2e.py more or fewer seconds; the whole
# script then takes about GPU_E2E_BUDGET_S + 90 s (at most GPU_E2E_BUDGET_S + 240 s).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log="$OUT/gpu_run.log"
say() { echo "[$(date +%T)] $*" | tee -a "$log"; }

say "gpu_run: $(uname -m), $($PY --version 2>&1), $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
WHL=${GPU_WHEELS:-.whl}   # (GPU_WHEELS, SITE: to check this script elsewhere with another wheel set)
SITE=${SITE:-/tmp/site}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHL"/*.whl >>"$log" 2>&1 || say "wheel install failed (rc $?)"
    # The Ray binaries (gcs_server, raylet) must stay executable.
    chmod +x "$SITE"/ray/core/src/ray/gcs/gcs_server "$SITE"/ray/core/src/ray/raylet/raylet 2>/dev/null
    export PYTHONPATH=$SITE:$PWD
else
    say "no $WHL/ here: using the Python environment as it is"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import torch, ray, cf_ray; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'ray', ray.__version__, 'cf_ray', cf_ray.__version__)" 2>&1 | tee -a "$log"

say "1/3 CUDA test of the slots"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_slots.py -k cuda -rs >"$OUT/slots_test.log" 2>&1
say "  rc $? ($(tail -1 "$OUT/slots_test.log"))"

say "2/3 gpu_snapshot.py"
timeout 90 $PY benchmarks/gpu_snapshot.py >"$OUT/gpu_snapshot.txt" 2>&1
say "  rc $?"

say "3/3 gpu_e2e.py"
budget=${GPU_E2E_BUDGET_S:-270}
timeout $((budget + 30)) $PY benchmarks/gpu_e2e.py --out "$OUT" --budget-s "$budget" "$@" >>"$log" 2>&1
say "  rc $?"
ls -la "$OUT" | tee -a "$log"

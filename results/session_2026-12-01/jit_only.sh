#!/usr/bin/env bash
# Issue 12 item 4 on a GPU: SGLang's kernels with only sglang/jit_kernel installed.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
COMMIT=$(cat COMMIT)
mkdir -p /tmp/deps /tmp/full /tmp/jk/sglang
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/deps ../.whl/simpy-*.whl ../.whl/apache_tvm_ffi-*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/full ../.whl/sglang-*.whl
cp -r /tmp/full/sglang/jit_kernel /tmp/jk/sglang/
export PYTHONPATH=$PWD:/tmp/jk:/tmp/deps
{
  printf '# command: bash jit_only.sh (sglang/jit_kernel alone on the path: %s)\n# commit: %s\n' "$(ls /tmp/jk/sglang)" "$COMMIT"
  python3 - <<'PY'
import sglang, os
print("sglang package:", getattr(sglang, "__path__", None), "has utils.py:", os.path.exists(os.path.join(list(sglang.__path__)[0], "utils.py")))
from gpu_backend.providers import get_provider
from gpu_backend import sglang_shim
p = get_provider("sglang", require_available=False)
print("sglang provider available:", p.available())
print("shim state:", sglang_shim.SHIM_STATE.get("sglang"))
PY
  CMD="python3 -m pytest -m gpu tests/test_gpu_providers.py -q -p no:cacheprovider -rs"
  echo "== KVRACE_REQUIRE_PROVIDERS=sglang $CMD"
  KVRACE_REQUIRE_PROVIDERS=sglang $CMD 2>&1 | tail -6
  for f in examples/index_k_ungated_race.json examples/engine_22811_window.json; do
    echo "== kvrace replay $f --provider sglang --mode controlled"
    python3 -m kvrace replay $f --provider sglang --mode controlled 2>&1 | tail -3; echo "exit ${PIPESTATUS[0]}"
  done
} > "$OUT/jit_kernel_only.txt" 2>&1
tail -25 "$OUT/jit_kernel_only.txt"

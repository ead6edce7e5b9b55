#!/usr/bin/env bash
# Replay examples/engine_22811_window.json controlled with each provider, and every example's
# controlled GPU test, on the submitted code; every text file names its command and commit.
set -uo pipefail
COMMIT=0d0cddbf0a89597c0f2813d8e86541c5b58633e6
OUT=${OUT:-out}/engine_window; mkdir -p "$OUT"
hdr() { printf '# command: %s\n# commit: %s\n' "$1" "$COMMIT"; }
{ hdr "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > "$OUT/gpu.txt"
{
  hdr "python3 -m kvrace replay examples/engine_22811_window.json --provider P --mode controlled --json engine_window_P.json (P below)"
  for p in sglang builtin torch; do
    echo "== python3 -m kvrace replay examples/engine_22811_window.json --provider $p --mode controlled --json engine_window_$p.json"
    python3 -m kvrace replay examples/engine_22811_window.json --provider $p --mode controlled --json "$OUT/engine_window_$p.json"
    echo "exit $?"
  done
} > "$OUT/engine_window_replay.txt" 2>&1
CMD="python3 -m pytest -m gpu tests/test_gpu_replay.py -q -p no:cacheprovider -rs -k every_example"
{ hdr "KVRACE_REQUIRE_PROVIDERS=sglang,builtin $CMD"; KVRACE_REQUIRE_PROVIDERS=sglang,builtin $CMD 2>&1; } > "$OUT/gpu_examples.log"
grep "^exit\|reads:" "$OUT/engine_window_replay.txt"; tail -2 "$OUT/gpu_examples.log"

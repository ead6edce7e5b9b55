#!/usr/bin/env bash
# One pass on a GPU machine: every GPU test, the free-mode sweep with the calibrated profile,
# and CLI replays of the examples. Writes under $OUT (or ./out). Needs .whl/ with the sglang,
# apache-tvm-ffi and simpy wheels when they are not installed (see docs/gpu_backend.md).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PROFILE=sim/profiles/h200-calibrated.toml
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
date -u >> "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/gpu_tests.log"
python3 benchmarks/free_sweep.py --out "$OUT" --profile "$PROFILE" --trials 100 2>&1 | tail -5 | tee "$OUT/free_sweep.log"
mkdir -p /tmp/replays
{
  for p in builtin torch sglang; do
    echo "== kvrace replay examples/index_k_ungated_race.json --provider $p --mode free --trials 200"
    python3 -m sim.cli replay examples/index_k_ungated_race.json --provider $p --mode free --trials 200 \
      --profile "$PROFILE" --json /tmp/replays/free_$p.json; echo "exit $?"
  done
  for f in examples/*.json; do
    echo "== kvrace replay $f --provider sglang --mode controlled"
    python3 -m sim.cli replay "$f" --provider sglang --mode controlled --profile "$PROFILE" \
      --json "/tmp/replays/controlled_$(basename "$f")"; echo "exit $?"
  done
} 2>&1 | tee "$OUT/replays.txt"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = {os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob("/tmp/replays/*.json"))}
json.dump(out, open(os.path.join(sys.argv[1], "replays.json"), "w"), indent=1)
PY

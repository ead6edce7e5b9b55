#!/usr/bin/env bash
# This session's GPU pass: GPU tests, controlled replays of every example, of the explorer's
# witnesses, of sim.testing's shrunk counterexample and of races exported by kvrace run.
set -uo pipefail
COMMIT=f9f9c69cac15ab83976257e46135f62e54162ca4
OUT=${OUT:-out}; mkdir -p "$OUT"
hdr() { printf '# command: %s\n# commit: %s\n' "$1" "$COMMIT"; }
{ hdr "nvidia-smi; date -u"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/gpu.txt"
if [ "${1:-all}" != "replays" ]; then
  CMD="python3 -m pytest -m gpu tests/ -q -p no:cacheprovider -rs --durations=10"
  { hdr "$CMD"; $CMD 2>&1; } > "$OUT/gpu_tests.log"; tail -3 "$OUT/gpu_tests.log"
fi
if [ "${1:-all}" != "tests" ]; then
  mkdir -p "$OUT/replays"
  {
    hdr "python3 -m kvrace replay FILE --provider sglang --mode controlled --json ... (each below)"
    rp() { echo "== kvrace replay $1 --provider sglang --mode controlled"; python3 -m kvrace replay "$1" --provider sglang --mode controlled --json "$OUT/replays/$2.json" 2>&1 | tail -4; echo "exit ${PIPESTATUS[0]}"; }
    for f in examples/*.json; do rp "$f" "example_$(basename "$f" .json)"; done
    for f in examples/index_k_ungated_race.json examples/engine_22811_window.json; do
      b=$(basename "$f" .json)
      echo "== kvrace explore $f --exhaustive --chunk 0 --witness-dir $OUT/witness/$b"
      python3 -m kvrace explore "$f" --exhaustive --chunk 0 --witness-dir "$OUT/witness/$b" --json "$OUT/witness/$b.json" | head -3
      for w in "$OUT/witness/$b"/*.json; do rp "$w" "witness_${b}_$(basename "$w" .json)"; done
    done
    for w in inputs/*.forced.json; do rp "$w" "testing_$(basename "$w" .json)"; done
    echo "== kvrace run glm5-22811-small --set run.layers=2 --export-races $OUT/races --export-limit 3"
    python3 -m kvrace run glm5-22811-small --set run.layers=2 --export-races "$OUT/races" --export-limit 3 --progress never | head -4
    for w in "$OUT/races"/*.json; do rp "$w" "race_$(basename "$w" .json)"; done
  } > "$OUT/replays.txt" 2>&1
  grep -c "^exit 0" "$OUT/replays.txt"; grep -c "^== kvrace replay" "$OUT/replays.txt"
fi

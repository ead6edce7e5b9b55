#!/usr/bin/env bash
# This session's GPU pass: GPU tests, controlled replays of every example, of the explorer's
# witnesses, of sim.testing's shrunk counterexample (inputs/, written by docs/testing.md's
# counterpart example) and of races exported by kvrace run. Every file names command and commit.
set -uo pipefail
COMMIT=19f950e372d27cef3b4cf4ce8b1899c60dc3b5d0
OUT=${OUT:-out}; mkdir -p "$OUT/replays" "$OUT/witness"
hdr() { printf '# command: %s\n# commit: %s\n' "$1" "$COMMIT"; }
{ hdr "nvidia-smi; date -u"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/gpu.txt"
CMD="python3 -m pytest -m gpu tests/ -q -p no:cacheprovider -rs --durations=10"
{ hdr "KVRACE_REQUIRE_PROVIDERS=sglang,builtin $CMD"; KVRACE_REQUIRE_PROVIDERS=sglang,builtin $CMD 2>&1; } > "$OUT/gpu_tests.log"
rp() { echo "== python3 -m kvrace replay $1 --provider $3 --mode controlled"; python3 -m kvrace replay "$1" --provider $3 --mode controlled --json "$OUT/replays/$2.json" 2>&1 | tail -4; echo "exit ${PIPESTATUS[0]}"; }
{
  hdr "the commands after each == line"
  for f in examples/*.json; do rp "$f" "example_$(basename "$f" .json)" sglang; done
  for f in examples/index_k_ungated_race.json examples/engine_22811_window.json; do
    b=$(basename "$f" .json)
    echo "== python3 -m kvrace explore $f --exhaustive --chunk 0 --witness-dir witness/$b --json witness/$b.json"
    python3 -m kvrace explore "$f" --exhaustive --chunk 0 --witness-dir "$OUT/witness/$b" --json "$OUT/witness/$b.json" | head -3
    for w in "$OUT/witness/$b"/*.json; do rp "$w" "witness_${b}_$(basename "$w" .json)" sglang; done
  done
  for p in builtin torch; do for w in inputs/*.forced.json; do rp "$w" "testing_$p" $p; done; done
  echo "== python3 -m kvrace run glm5-22811-small --set run.layers=2 --export-races races --export-limit 3"
  python3 -m kvrace run glm5-22811-small --set run.layers=2 --export-races "$OUT/races" --export-limit 3 --progress never | head -4
  for w in "$OUT/races"/*.json; do rp "$w" "race_$(basename "$w" .json)" sglang; done
} > "$OUT/replays.txt" 2>&1
tail -2 "$OUT/gpu_tests.log"; echo "replays exit 0: $(grep -c '^exit 0' "$OUT/replays.txt") of $(grep -c '^== python3 -m kvrace replay' "$OUT/replays.txt")"
rm -rf "$OUT/replays" "$OUT/witness"/*/ "$OUT/races"

#!/usr/bin/env bash
# GPU fidelity pass (issue 12) on a GPU machine; writes under $OUT (or ./out).
#   bash benchmarks/fidelity_pass.sh scan      # race-window scans only
#   bash benchmarks/fidelity_pass.sh measure   # race-window scans + free sweeps measured (no prediction)
#   bash benchmarks/fidelity_pass.sh agree     # the minimal race + the agreement test only
#   bash benchmarks/fidelity_pass.sh verify    # GPU agreement test + free sweeps with predictions
#   bash benchmarks/fidelity_pass.sh final     # round 3: minimal race, agreement test, provider tests, bench (+ tarball)
# Every file it writes names its command and commit (KVRACE_COMMIT when the tree has no .git).
set -uo pipefail
PHASE=${1:-measure}
OUT=${OUT:-out}; mkdir -p "$OUT"
COMMIT=${KVRACE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export KVRACE_COMMIT=$COMMIT
export PYTHONPATH=$PWD:${PYTHONPATH:-}
: > "$OUT/PROVENANCE.txt"
step() {  # step NAME TIMEOUT_S CMD...: run CMD, log to $OUT/NAME.log with its command and commit
  local name=$1 t=$2; shift 2
  printf '%s\tcommand: %s\tcommit: %s\n' "$name.log" "$*" "$COMMIT" >> "$OUT/PROVENANCE.txt"
  { printf '# command: %s\n# commit: %s\n' "$*" "$COMMIT"; s=$(date +%s); timeout "$t" "$@" 2>&1; echo "exit $? after $(( $(date +%s) - s )) s"; } > "$OUT/$name.log"
  tail -3 "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; nproc; } > "$OUT/gpu.txt"
EX=examples/index_k_ungated_race.json
if [ "$PHASE" = scan ]; then
  step spread 240 python3 -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX \
    --budget-s 12 --out "$OUT/spread.json" \
    --command "python -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX --budget-s 12" --commit "$COMMIT"
elif [ "$PHASE" = agree ]; then
  export KVRACE_REQUIRE_PROVIDERS=builtin,sglang KVRACE_AGREEMENT_OUT="$OUT"
  step race_sglang 40 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 --profile sim/profiles/h200-calibrated-sglang.toml --json "$OUT/race_sglang.json"
  step agreement 270 python3 -m pytest -m gpu tests/test_gpu_agreement.py -q -p no:cacheprovider -rxXs
elif [ "$PHASE" = final ]; then
  # round 3: everything on the final code, the race-probability results first; one tarball back
  export KVRACE_REQUIRE_PROVIDERS=builtin,sglang KVRACE_AGREEMENT_OUT="$OUT"
  step race_sglang 45 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 --profile sim/profiles/h200-calibrated-sglang.toml --json "$OUT/race_sglang.json"
  step agreement 270 python3 -m pytest -m gpu tests/test_gpu_agreement.py -q -p no:cacheprovider -rxXs
  step gpu_providers 120 python3 -m pytest -m gpu tests/test_gpu_providers.py -q -p no:cacheprovider -rs
  step bench_providers 90 python3 benchmarks/bench_providers.py --out "$OUT/bench"
  tar -C "$OUT" -czf "${TARBALL:-/tmp/final_round3.tgz}" .
elif [ "$PHASE" = measure ]; then
  step spread 200 python3 -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX \
    --profile sim/profiles/h200-calibrated-sglang.toml --budget-s 12 --out "$OUT/spread.json" \
    --command "python -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX --profile sim/profiles/h200-calibrated-sglang.toml --budget-s 12" --commit "$COMMIT"
  mkdir -p "$OUT/sweep_sglang" "$OUT/sweep_builtin"
  step sweep_sglang 125 python3 benchmarks/free_sweep.py --out "$OUT/sweep_sglang" --provider sglang --bytes 128,256,512,1024 --trials 100 --timed 9 --measure-only
  step sweep_builtin 110 python3 benchmarks/free_sweep.py --out "$OUT/sweep_builtin" --provider builtin --trials 100 --timed 9 --measure-only
  step race_sglang 45 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 --profile sim/profiles/h200-calibrated-sglang.toml --json "$OUT/race_sglang.json"
else
  export KVRACE_REQUIRE_PROVIDERS=builtin,sglang
  step gpu_providers 110 python3 -m pytest -m gpu tests/test_gpu_providers.py -q -p no:cacheprovider -x
  step bench_providers 90 python3 benchmarks/bench_providers.py --out "$OUT/bench"
  step race_sglang 40 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 --profile sim/profiles/h200-calibrated-sglang.toml --json "$OUT/race_sglang.json"
  # the agreement test also writes the free sweep of both providers (measured + predicted) under $OUT
  export KVRACE_AGREEMENT_OUT="$OUT"
  step agreement 270 python3 -m pytest -m gpu tests/test_gpu_agreement.py -q -p no:cacheprovider -rxXs
fi

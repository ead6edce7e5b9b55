#!/usr/bin/env bash
# A calibrated profile pair for the GPU at hand, made the way the H200 pair was made
# (sim/profiles/h200-calibrated.toml, h200-calibrated-sglang.toml; docs/gpu_backend.md "Calibration",
# docs/timing.md), then the GPU agreement test against it. Writes under $OUT (or ./out).
#   bash benchmarks/calibrate_pass.sh measure  # GPU: kvrace calibrate (full), its sglang refit, the
#                                              # race-window scans, the measured sweeps, the minimal race
#   bash benchmarks/calibrate_pass.sh fit      # no GPU: spread_fit and row_fit of both profiles from
#                                              # $MEASURED (default $OUT), written to $PROFILE_DIR/$NAME{,-sglang}.toml
#   bash benchmarks/calibrate_pass.sh agree    # GPU: tests/test_gpu_agreement.py against those two profiles
#   bash benchmarks/calibrate_pass.sh all      # measure, fit, agree; agree only if DEADLINE_S (560) leaves time
# NAME (default h100-calibrated) names the builtin profile; the sglang one is $NAME-sglang.
# Every log starts with "# command:" and "# commit:" lines; PROVENANCE_<phase>.txt lists them all.
# The commit is KVRACE_COMMIT when set (a device machine has no .git), else `git rev-parse HEAD`.
set -uo pipefail
PHASE=${1:-all}
OUT=${OUT:-out}; mkdir -p "$OUT"
COMMIT=${KVRACE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export KVRACE_COMMIT=$COMMIT
NAME=${NAME:-h100-calibrated}
PROFILE_DIR=${PROFILE_DIR:-sim/profiles}
DEADLINE_S=${DEADLINE_S:-560}
EX=examples/index_k_ungated_race.json
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ -z "${KVRACE_NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

qcmd() {  # the command line, arguments with spaces in single quotes
  local a s=""
  for a in "$@"; do case $a in *[[:space:]]*|'') s+=" '$a'" ;; *) s+=" $a" ;; esac; done
  printf '%s' "${s# }"
}
step() {  # step NAME TIMEOUT_S CMD...: run CMD, log to $OUT/NAME.log with its command and commit
  local name=$1 t=$2; shift 2
  printf '%s\tcommand: %s\tcommit: %s\n' "$name.log" "$(qcmd "$@")" "$COMMIT" >> "$OUT/PROVENANCE_$CUR.txt"
  { printf '# command: %s\n# commit: %s\n' "$(qcmd "$@")" "$COMMIT"; s=$(date +%s); timeout "$t" "$@" 2>&1
    echo "exit $? after $(( $(date +%s) - s )) s"; } > "$OUT/$name.log"
  echo "== $name"; tail -3 "$OUT/$name.log"
}
gpu_info() {
  { printf '# command: nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; nproc\n# commit: %s\n' "$COMMIT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; nproc; } > "$OUT/gpu_$CUR.txt"
}

measure() {
  CUR=measure; : > "$OUT/PROVENANCE_$CUR.txt"; gpu_info
  # 1. kvrace calibrate, full level (as on the H200; --name gives the profile its file's name)
  step calibrate 140 python3 -m kvrace calibrate --out "$OUT/$NAME.toml" --name "$NAME"
  # 2. the same measurements refitted to SGLang's JIT kernels (h200-calibrated-sglang's first step)
  step refit_sglang 20 python3 -m gpu_backend.calibrate --refit "$OUT/$NAME.toml" --out "$OUT/$NAME-sglang.toml" \
    --name "$NAME-sglang" --link-provider sglang
  # 3. race-window scans of both providers and the minimal race (fidelity_pass.sh scan)
  step spread 130 python3 -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX \
    --budget-s 12 --out "$OUT/spread.json" \
    --command "python -m gpu_backend.calibrate.spread --provider sglang --provider builtin --example $EX --budget-s 12" \
    --commit "$COMMIT"
  # 4. the measured sweeps with timed copies and the minimal race's 400 trials (fidelity_pass.sh measure)
  mkdir -p "$OUT/sweep_sglang" "$OUT/sweep_builtin"
  step sweep_sglang 120 python3 benchmarks/free_sweep.py --out "$OUT/sweep_sglang" --provider sglang \
    --bytes 128,256,512,1024 --trials 100 --timed 9 --measure-only
  step sweep_builtin 100 python3 benchmarks/free_sweep.py --out "$OUT/sweep_builtin" --provider builtin --trials 100 \
    --timed 9 --measure-only
  step race_sglang 40 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 \
    --profile "$OUT/$NAME-sglang.toml" --json "$OUT/race_sglang.json"
}

fit() {
  CUR=fit; : > "$OUT/PROVENANCE_$CUR.txt"
  local m=${MEASURED:-$OUT} p=$PROFILE_DIR dev day mc
  dev=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['providers']['builtin']['device'])" "$m/spread.json")
  day=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['providers']['builtin']['date'])" "$m/spread.json")
  mc=$(python3 -c "import json,sys; print(str(json.load(open(sys.argv[1]))['provenance']['commit'])[:10])" "$m/spread.json")
  local what="the measured sweep of one device session ($dev, $day, commit $mc)"
  # 5. [timing] tables and the link refit from the scans and the sweep's timed copies (spread_fit)
  step fit_spread_builtin 60 python3 -m gpu_backend.calibrate.spread_fit --spread "$m/spread.json" --provider builtin \
    --profile "$m/$NAME.toml" --sweep "$m/sweep_builtin/free_sweep.csv" --out "$p/$NAME.toml"
  step fit_spread_sglang 60 python3 -m gpu_backend.calibrate.spread_fit --spread "$m/spread.json" --provider sglang \
    --profile "$m/$NAME-sglang.toml" --sweep "$m/sweep_sglang/free_sweep.csv" --out "$p/$NAME-sglang.toml"
  # 6. row factors with the bucket offsets, and the session jitter (row_fit, every row's factor free)
  step fit_rows_builtin 120 python3 -m gpu_backend.calibrate.row_fit --profile "$p/$NAME.toml" \
    --sweep "$m/sweep_builtin/free_sweep.csv" --what "$what" --out "$p/$NAME.toml"
  step fit_rows_sglang 120 python3 -m gpu_backend.calibrate.row_fit --profile "$p/$NAME-sglang.toml" \
    --sweep "$m/sweep_sglang/free_sweep.csv" --schedule $EX --replay "$m/race_sglang.json" \
    --what "$what and the minimal race's 400-trial replay (race_sglang.json)" --out "$p/$NAME-sglang.toml"
  if [ "$(cd "$p" && pwd)" != "$(cd "$OUT" && pwd)" ]; then
    cp "$p/$NAME.toml" "$OUT/fitted_$NAME.toml"; cp "$p/$NAME-sglang.toml" "$OUT/fitted_$NAME-sglang.toml"
  fi
  sha256sum "$p/$NAME.toml" "$p/$NAME-sglang.toml" > "$OUT/fitted.sha256"
}

agree() {  # agree [TIMEOUT_S]
  CUR=agree; : > "$OUT/PROVENANCE_$CUR.txt"; gpu_info
  local t=${1:-300} p=$PROFILE_DIR
  sha256sum "$p/$NAME.toml" "$p/$NAME-sglang.toml" > "$OUT/agree_profiles.sha256"
  step agreement "$t" env KVRACE_REQUIRE_PROVIDERS=builtin,sglang KVRACE_AGREEMENT_OUT="$OUT" \
    KVRACE_AGREEMENT_PROFILE_BUILTIN="$p/$NAME.toml" KVRACE_AGREEMENT_PROFILE_SGLANG="$p/$NAME-sglang.toml" \
    python3 -m pytest -m gpu tests/test_gpu_agreement.py -q -p no:cacheprovider -rxXs
  if [ $(( DEADLINE_S - SECONDS )) -ge 40 ]; then
    step race_sglang_agree 35 python3 -m kvrace replay $EX --provider sglang --mode free --trials 400 \
      --profile "$p/$NAME-sglang.toml" --json "$OUT/race_sglang_agree.json"
  fi
}

case $PHASE in
  measure) measure ;;
  fit) fit ;;
  agree) agree ;;
  all)
    measure; fit
    left=$(( DEADLINE_S - SECONDS ))
    if [ "$left" -ge 150 ]; then
      agree $(( left - 10 < 300 ? left - 10 : 300 ))
    else
      echo "agree not run: ${left} s left of DEADLINE_S=$DEADLINE_S" | tee "$OUT/agree_not_run.txt"
    fi ;;
  *) echo "usage: $0 measure|fit|agree|all" >&2; exit 2 ;;
esac
echo "calibrate_pass.sh $PHASE: done after $SECONDS s"

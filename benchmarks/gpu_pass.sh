#!/usr/bin/env bash
# One pass on a GPU machine: every GPU test, the free-mode sweep with the calibrated profile,
# and CLI replays of the examples. Writes under $OUT (or ./out). Needs .whl/ with the sglang,
# apache-tvm-ffi and simpy wheels when they are not installed (see docs/gpu_backend.md).
#
# Provenance: every text file it writes starts with "# command: ..." and "# commit: ..." lines,
# replays.json carries a "provenance" entry, and $OUT/PROVENANCE.txt names the command and commit
# of every file (the CSV and PNG included). The commit is KVRACE_COMMIT when set (a copy of the
# working tree without .git, e.g. on a device machine: pass KVRACE_COMMIT=$(git rev-parse HEAD)),
# else `git rev-parse HEAD`, with "+uncommitted" appended when the tree differs from that commit.
# Results from a tree that is not a commit cannot be reproduced: commit first.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${KVRACE_COMMIT:-}" ]; then
  COMMIT=$KVRACE_COMMIT
elif COMMIT=$(git rev-parse HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || COMMIT="$COMMIT+uncommitted"
else
  COMMIT=unknown
  echo "gpu_pass.sh: no .git here and KVRACE_COMMIT is not set: results will name commit 'unknown'" >&2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PROFILE=sim/profiles/h200-calibrated.toml
header() { printf '# command: %s\n# commit: %s\n' "$1" "$COMMIT"; }
provenance() { printf '%s\tcommand: %s\tcommit: %s\n' "$1" "$2" "$COMMIT" >> "$OUT/PROVENANCE.txt"; }
: > "$OUT/PROVENANCE.txt"

CMD="nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u"
{ header "$CMD"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > "$OUT/gpu.txt"
provenance gpu.txt "$CMD"

CMD="python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --durations=5"
{ header "$CMD"; $CMD 2>&1; } | tee "$OUT/gpu_tests.log"
provenance gpu_tests.log "$CMD"

CMD="python3 benchmarks/free_sweep.py --out $OUT --profile $PROFILE --trials 100"
{ header "$CMD 2>&1 | tail -5"; $CMD 2>&1 | tail -5; } | tee "$OUT/free_sweep.log"
for f in free_sweep.log free_sweep.csv free_sweep.png; do provenance $f "$CMD"; done

mkdir -p /tmp/replays
{
  header "python3 -m kvrace replay ... (each run below; JSON in replays.json)"
  for p in builtin torch sglang; do
    CMD="python3 -m kvrace replay examples/index_k_ungated_race.json --provider $p --mode free --trials 200 --profile $PROFILE --json /tmp/replays/free_$p.json"
    echo "== $CMD"
    $CMD; echo "exit $?"
  done
  for f in examples/*.json examples/bugs/*.json; do
    CMD="python3 -m kvrace replay $f --provider sglang --mode controlled --profile $PROFILE --json /tmp/replays/controlled_$(basename "$f")"
    echo "== $CMD"
    $CMD; echo "exit $?"
  done
} 2>&1 | tee "$OUT/replays.txt"
provenance replays.txt "the kvrace replay commands named in replays.txt"
python3 - "$OUT" "$COMMIT" <<'PY'
import glob, json, os, sys
out = {"provenance": {"command": "benchmarks/gpu_pass.sh: the kvrace replay runs in replays.txt, one JSON each",
                      "commit": sys.argv[2]}}
out.update({os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob("/tmp/replays/*.json"))})
json.dump(out, open(os.path.join(sys.argv[1], "replays.json"), "w"), indent=1)
PY
provenance replays.json "the kvrace replay commands named in replays.txt (merged by gpu_pass.sh)"

set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
D=results/session_2026-12-07_31/pd_early_send_window
mkdir -p $OUT/r
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $OUT/r/gpu.txt
for p in sglang builtin; do for f in $D/race_*.json; do
  echo "== kvrace replay $f --provider $p --mode controlled --profile sim/profiles/h200-calibrated.toml"
  python3 -m kvrace replay $f --provider $p --mode controlled --profile sim/profiles/h200-calibrated.toml --json $OUT/r/controlled_${p}_$(basename $f); echo "exit $?"
done; done > $OUT/r/replays.txt 2>&1
tar czf $OUT/pass.tgz -C $OUT r && rm -r $OUT/r

set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
python3 -m pytest -m gpu tests/test_gpu_replay.py -q -p no:cacheprovider -rs > $OUT/gpu_replay_tests.log 2>&1; echo "pytest exit $?" >> $OUT/gpu_replay_tests.log
for p in sglang builtin; do for f in examples/bugs/pd_early_send.json examples/bugs/pd_buffer_store_unsynced.json examples/bugs/mamba_cow_before_load.json examples/bugs/prefill_stall_behind_load.json examples/bugs/prefill_stall_behind_load_fixed.json examples/bugs/pd_early_send_fixed.json examples/bugs/pd_buffer_store_unsynced_fixed.json examples/bugs/mamba_cow_before_load_fixed.json; do
  echo "== kvrace replay $f --provider $p --mode controlled --profile sim/profiles/h200-calibrated.toml"
  python3 -m kvrace replay $f --provider $p --mode controlled --profile sim/profiles/h200-calibrated.toml --json $OUT/controlled_${p}_$(basename $f); echo "exit $?"; done; done > $OUT/replays.txt 2>&1
mkdir -p $OUT/r && mv $OUT/*.json $OUT/*.txt $OUT/*.log $OUT/r/; tar czf $OUT/pass.tgz -C $OUT r && rm -r $OUT/r
tar tzf $OUT/pass.tgz | wc -l

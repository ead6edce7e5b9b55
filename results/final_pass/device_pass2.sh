#!/usr/bin/env bash
# The second, short GPU call of the final pass: after the batched KV store (cb7199c) regenerated
# examples/engine_22811_window.json and moved the overlap loop's unfenced run to 5 layers, the
# engine window replayed controlled with each provider, and the races `kvrace run` exports from
# that run replayed with the builtin kernels (SGLang's JIT kernel refuses their 656 B latent rows
# and sgl_kernel is not installed on the device). Every text file names command and commit.
# Run as: OUT=out COMMIT=<sha> bash results/final_pass/device_pass2.sh  (from the repo root)
set -uo pipefail
OUT=${OUT:-out}; R=$OUT/res; mkdir -p "$R/engine_window" "$R/overlap"
hdr() { printf '# command: %s\n# commit: %s\n' "$1" "$COMMIT"; }
{ hdr "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > "$R/engine_window/gpu.txt"
rp() {  # example, json out, provider
  echo "== python3 -m kvrace replay $1 --provider $3 --mode controlled --json $(basename "$2")"
  python3 -m kvrace replay "$1" --provider "$3" --mode controlled --json "$2" 2>&1 | tail -6; echo "exit ${PIPESTATUS[0]}"; }
{ hdr "the commands after each == line"
  for p in sglang builtin torch; do rp examples/engine_22811_window.json "$R/engine_window/engine_window_$p.json" $p; done; } > "$R/engine_window/engine_window_replay.txt"
RUN="python3 -m kvrace run glm5-22811-small --set run.layers=5 --set variant.gate_map=upstream-0.5.11 --set scheduler.event_loop=overlap --set workload.sessions=5 --set workload.max_turns=3 --set workload.concurrency=4 --set scheduler.max_total_tokens=1536 --set workload.max_context_tokens=1472 --set variant.hypotheses=load-unfenced --export-races $R/overlap --export-limit 3 --progress never --fail-on none"
{ hdr "the commands after each == line"
  echo "== $RUN"; $RUN 2>&1 | tail -25
  for w in "$R/overlap"/race_*.json; do rp "$w" "$R/overlap/$(basename "$w" .json)_builtin.report.json" builtin; done; } > "$R/overlap/overlap_replay.txt"
for f in "$R"/*/*_replay.txt; do echo "$f: exit 0 in $(grep -c '^exit 0' "$f") of $(grep -c '^== python3 -m kvrace replay' "$f")"; done
tar -C "$R" -czf "$OUT/final_pass2.tgz" .

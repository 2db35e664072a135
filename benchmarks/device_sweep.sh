#!/usr/bin/env bash
# One part of a resumable bench sweep on the GPU machine, its results brought back in one file.
#
#   bash benchmarks/device_sweep.sh SUITE BENCH_DIR BUDGET_S [more `kernelpro bench` options]
#
# SUITE: a folder of task files carried with the call (e.g. a copy of KernelBench's level1 in an ignored
# folder); BENCH_DIR: the bench folder kept in the repository (benchmarks/results/bench-level1), copied to
# /tmp and resumed there, so the repository's copy changes only when its files are copied back by hand
# (benchmarks/merge_sweep.sh). BENCH_DIR may be a new, empty folder: the bench is then begun there.
# WHEELS (optional): a folder of wheels the image lacks (nvidia-cutlass for the GEMM families), installed
# first. CONTINUE=1: resume the /tmp copy an earlier part of the same call left (e.g. a --retry part, then
# the rest), so the one file brought back holds both parts' runs. Writes $OUT/sweep-NAME.tgz (NAME: BENCH_DIR's name): the bench's manifest (bench.json), rows (results.jsonl, and
# results.retried.jsonl with --retry), summary.json, report.md, report.html, bench.out / bench.err, doctor.txt (the
# toolchain it ran with) and runs/*/log.jsonl of this part's runs. One file: the device tool brings back
# only a few a call, and the sweep may share its call with other work.
# HARD_S (optional): seconds after which the bench is interrupted (SIGINT, then killed 30 s later) so that
# the packing below still runs inside the device call's limit: BUDGET_S only stops new tasks from starting,
# and a task already started runs to its end (a level-3 task takes 4 minutes). The rows of the tasks that
# finished come back; the interrupted task has none and runs again on --resume.
set -u
suite=${1:?usage: device_sweep.sh SUITE BENCH_DIR BUDGET_S [bench options]}
bench=${2:?}; budget=${3:?}; shift 3
out=${OUT:?run this through the device tool: OUT is its output folder}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
name=$(basename "$bench")
work=/tmp/sweep-$name
# The part's own files sit beside the bench folder until the bench has run: a new bench wants an empty one.
if [ "${CONTINUE:-0}" = 1 ] && [ -f "$work.started" ]; then
  echo "continuing $work"
else
  rm -rf "$work" "$work".* && cp -r "$bench" "$work" && chmod -R u+w "$work"
  python3 -m pipeline.cli doctor > "$work.doctor.txt" 2>&1
  touch "$work.started"  # the runs written after this are this part's
fi
hard=()
[ -n "${HARD_S:-}" ] && hard=(timeout --signal=INT --kill-after=30 "$HARD_S")
${hard[@]+"${hard[@]}"} python3 -m pipeline.cli bench "$suite" --out "$work" --resume --budget-s "$budget" "$@" \
  >> "$work.bench.out" 2>> "$work.bench.err"
echo "rc=$?" >> "$work.bench.out"
mkdir -p "$work"
for f in doctor.txt bench.out bench.err; do cp "$work.$f" "$work/$f"; done
(cd "$work" && {
  for f in bench.json results.jsonl results.retried.jsonl summary.json report.md report.html bench.out bench.err doctor.txt; do
    [ -f "$f" ] && printf '%s\0' "$f"
  done
  find runs -maxdepth 2 -name log.jsonl -newer "$work.started" -print0 2>/dev/null
} | tar czf "$out/sweep-$name.tgz" --null -T -)
tail -4 "$work.bench.err"; tail -4 "$work.bench.out"

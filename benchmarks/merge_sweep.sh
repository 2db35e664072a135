#!/usr/bin/env bash
# Bring one device sweep's results (the $OUT/sweep-NAME.tgz of benchmarks/device_sweep.sh, fetched here)
# into the bench folder kept in the repository:
#
#   bash benchmarks/merge_sweep.sh SWEEP.tgz BENCH_DIR
#
# The bench's manifest (bench.json), rows and reports (results.jsonl, results.retried.jsonl, summary.json, report.md, report.html)
# replace the kept ones: the tar holds the whole store as the sweep left it, the kept rows among them. Each
# new run's log is kept compressed as BENCH_DIR/logs/<run id>.jsonl.gz (the run folders themselves stay
# out of the repository). Prints what it took.
set -eu
tgz=${1:?usage: merge_sweep.sh SWEEP.tgz BENCH_DIR}
bench=${2:?usage: merge_sweep.sh SWEEP.tgz BENCH_DIR}
[ -f "$tgz" ] || { echo "no such sweep: $tgz" >&2; exit 2; }
# a new bench's folder may be empty (or not made yet); one holding other files is the wrong folder
mkdir -p "$bench"
if [ ! -f "$bench/results.jsonl" ] && [ -n "$(ls -A "$bench")" ]; then
  echo "not a bench folder (files, but no results.jsonl): $bench" >&2; exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$tgz" -C "$work"
[ -f "$work/results.jsonl" ] || { echo "the sweep holds no results.jsonl: $tgz" >&2; exit 2; }
for f in bench.json results.jsonl results.retried.jsonl summary.json report.md report.html; do
  if [ -f "$work/$f" ]; then cp "$work/$f" "$bench/$f"; echo "took $f"; fi
done
mkdir -p "$bench/logs"
n=0
for log in "$work"/runs/*/log.jsonl; do
  [ -f "$log" ] || continue
  id=$(basename "$(dirname "$log")")
  gzip -c "$log" > "$bench/logs/$id.jsonl.gz"
  n=$((n + 1))
done
echo "took $n run log(s) into $bench/logs"
tail -3 "$work/bench.out" 2>/dev/null || true

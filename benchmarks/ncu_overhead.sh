#!/usr/bin/env bash
# Where an Nsight Compute profile's seconds go, on the GPU machine: a Python process that imports torch and
# runs one softmax call between cudaProfilerStart and Stop (as pipeline/profile/target.py does), alone and
# under ncu with one metric, with pipeline/profile/metrics.txt, and with the caches left alone.
#
#   bash benchmarks/ncu_overhead.sh        # prints "<seconds> s :: <command>" a line
set -u
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
metrics=$(grep -v '^#' "$(dirname "$0")/../pipeline/profile/metrics.txt" | grep . | paste -sd, -)
script=$(mktemp --suffix=.py)
cat > "$script" <<'PY'
import torch
x = torch.randn(4096, 8192, device="cuda")
for _ in range(2):
    torch.softmax(x, -1)
torch.cuda.synchronize()
torch.cuda.profiler.start()
torch.softmax(x, -1)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
PY
TIMEFORMAT=%R
timed() {  # the wall seconds of a command, its output discarded
  local s
  s=$( { time "$@" > /dev/null 2>&1; } 2>&1 )
  echo "$s s :: $1 ${*:2:1} ... (${#@} words)"
}
common=(--clock-control none --target-processes all --profile-from-start off --csv --page raw --print-units base)
timed python3 -c "import torch; torch.cuda.init(); torch.empty(1, device='cuda')"
timed python3 "$script"
timed "$ncu" "${common[@]}" --cache-control all --metrics gpu__time_duration.sum python3 "$script"
timed "$ncu" "${common[@]}" --cache-control all --metrics "$metrics" python3 "$script"
timed "$ncu" "${common[@]}" --cache-control none --metrics "$metrics" python3 "$script"
timed "$ncu" "${common[@]}" --cache-control all --metrics "$metrics" python3 "$script"
rm -f "$script"

#!/usr/bin/env bash
# Where the delegate's first refit goes (fourteenth session: 0.41 s, of which 0.35 s ending
# its two graph captures; copies out of IPC-mapped memory end a capture in 0.2 ms for 42,
# benchmarks/mapped_capture_lab.py): the profile of one_sided_first_refit.py --collocated
# with the kernel cache warm, as is, without the batched copy kernel
# (TORCHREFIT_BATCHED_COPY=0) and without SM copies for mid-sized ones
# (TORCHREFIT_SM_COPY_BELOW=0); turns (TORCHREFIT_DELEGATE=0) for reference.
# Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run delegate_capture
P="python3 benchmarks/one_sided_first_refit.py --transport ipc --collocated"
timeout 100 $P >/dev/null 2>&1  # fills the copy kernel's disk cache
for v in "" TORCHREFIT_BATCHED_COPY=0 TORCHREFIT_SM_COPY_BELOW=0 TORCHREFIT_DELEGATE=0; do
  echo "=== ${v:-as is} ($(date +%T))"
  env $v timeout 100 $P 2>&1 | grep -E "^rank|capture_end|_capture|nvrtc|compile_copies|tiles|strided_runs" | head -24
done
echo "=== done ($(date +%T))"

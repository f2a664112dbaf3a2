#!/usr/bin/env bash
# Twenty-first session, second call: issue 10's ipc with the dict-watching native check.
# 1. build; 2. one_sided_first_refit.py non-collocated with --warm-profile (on the host
# clock both processes share: when each left the barrier, posted / saw the header,
# returned, finished); 3. torchrefit bench ipc (gpt-4b, watch every): non-collocated 2
# processes, collocated TP2 -> TP1 with 2 and 4; 4. the qwen3 toy's first refit once more.
# Nothing to carry. Results and log in $OUT. About 4 minutes.
source benchmarks/_h200_run.sh
h200_run twentyfirst_ipc
python3 -m torchrefit native build >/dev/null && echo "native built" || echo "not built"
echo "=== 2. one_sided_first_refit non-collocated ($(date +%T))"
timeout 150 python3 benchmarks/one_sided_first_refit.py --transport ipc --warm-profile 2>&1 \
  | grep -E "^rank [0-9]: (refit wall|left the|construct|[0-9.]+ GB)|tottime|^ +[0-9]+ +[0-9.]+ " | cut -c1-160 | head -60
B="python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 --transport ipc"
echo "=== 3. ipc bench ($(date +%T))"
timeout 50 $B --mode non-collocated --nproc 2 --label noncolloc2 --json "$R/noncolloc2.json" 2>&1 | tail -1
timeout 50 $B --src tp2 --dst tp1 --nproc 2 --label colloc2 --json "$R/colloc2.json" 2>&1 | tail -1
timeout 60 $B --src tp2 --dst tp1 --nproc 4 --label colloc4 --json "$R/colloc4.json" 2>&1 | tail -1
echo "=== 4. qwen3 toy first refit ($(date +%T))"
timeout 60 python3 -m torchrefit bench --model qwen3-30b-a3b --layers 8 --variant graph --warmup 2 --iters 5 \
  --json "$R/qwen3.json" 2>&1 | tail -2
python3 -c "import json; d=json.load(open('$R/qwen3.json')); print('first refit s', [round(c['first_refit_s'], 3) for c in d['configs']])"
echo "=== done ($(date +%T))"

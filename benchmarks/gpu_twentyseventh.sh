#!/usr/bin/env bash
# Twenty-seventh session, on whichever card comes (the log names it), about 3 minutes:
# does the batched copy lose its last 1-2% on the device to its tile table?
# `tile_table_lab.py` on qwen3-30b-a3b (8 layers), dense-0.5b and deepseek-v3-moe (1 layer):
# the executor's table kernel against a kernel that reads a 4-byte run index per tile,
# at several shapes, a table-free flat kernel, memcpy (flat and 8 branches).
#   bash benchmarks/gpu_twentyseventh.sh
# Nothing to carry. Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run twentyseventh
h200_card
(cd benchmarks && timeout 400 python3 tile_table_lab.py --json "$R/tile_table_lab.json")
echo "=== done ($(date +%T))"

#!/usr/bin/env bash
# Twenty-seventh session: does the batched copy lose its last 1-2% on the device to its
# tile table?
#   bash benchmarks/gpu_twentyseventh.sh lab   # call 1 (an H100, main at e9820a4, ~1.5 min):
#     tile_table_lab.py on qwen3-30b-a3b (8 layers), dense-0.5b, deepseek-v3-moe (1 layer):
#     the executor's kernel (then 24-byte tile rows) against a kernel reading a 4-byte run
#     index per tile at several shapes, a table-free flat kernel, memcpy (flat, 8 branches)
#   bash benchmarks/gpu_twentyseventh.sh h100   # an H100, .whl/megatron carried, ~5 min: the GPU tests
#     (h200_gpu_tests) and the matrix less deepseek-v3-moe (out of an H100's memory)
#   (call 2 ran the h100 mode with `-k "two_processes and ipc"` on the tests, which kept only
#   the two ipc cases of test_gpu_one_sided.py; call 3 ran all three files: 13 passed)
#   bash benchmarks/gpu_twentyseventh.sh matrix   # an H200 (needs_h200), .whl/megatron: the matrix alone
#   bash benchmarks/gpu_twentyseventh.sh moe   # an H200 (needs_h200): qwen3's and deepseek's toy rows
#   bash benchmarks/gpu_twentyseventh.sh h200   # an H200 (needs_h200: the deepseek rows need
#     its memory), .whl/megatron carried, ~8 min: with the index kernel on main, the GPU
#     tests of the batched copy and the refit, the shape matrix (megatron-core side by side),
#     then the lab on the tree before the index (benchmarks/patches/tile_index.patch
#     reverted: its "table 128x2" row is the 24-byte rows) with deepseek at the matrix's 2 layers
# Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run twentyseventh
h200_card

done_and_exit() {
  echo "=== done ($(date +%T))"
  exit 0
}

mode=${1:-lab}
if [ "$mode" = lab ]; then
  (cd benchmarks && timeout 400 python3 tile_table_lab.py --json "$R/tile_table_lab.json")
  done_and_exit
fi
h200_with_megatron || echo "megatron-core not carried: toy models only"
case $mode in
  h100)  # an H100, ~5 min: the GPU tests, then the matrix less deepseek (its two models need an H200)
    h200_gpu_tests
    h200_matrix 240 h100_shape_matrix.json --only qwen3-30b-a3b --only dense-0.5b --only llama-8b --only gpt-4b
    done_and_exit ;;
  moe)  # an H200's MoE toy rows alone (needs_h200 for deepseek), ~2 min
    h200_matrix 200 h200_moe_rows.json --no-megatron --only qwen3-30b-a3b --only deepseek-v3-moe
    done_and_exit ;;
  matrix)  # the H200 matrix alone, ~4 min
    h200_matrix 300 h200_shape_matrix.json
    done_and_exit ;;
  h200) ;;
  *) echo "unknown mode: $mode"; exit 2 ;;
esac
echo "=== 1. GPU tests ($(date +%T))"
h200_gpu_tests
echo "=== 2. shape matrix ($(date +%T))"
h200_matrix 300 h200_shape_matrix.json
echo "=== 3. lab, tile rows ($(date +%T))"
DIR=$(h200_patched_tree benchmarks/patches/tile_index.patch -R) || exit 1
(cd "$DIR/benchmarks" && LAB_DEEPSEEK_LAYERS=2 PYTHONPATH="$DIR/src" timeout 110 python3 tile_table_lab.py \
  --only qwen3,deepseek --json "$R/tile_table_lab_rows.json")
done_and_exit

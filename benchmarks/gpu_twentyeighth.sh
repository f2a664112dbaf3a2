#!/usr/bin/env bash
# Twenty-eighth session: two questions the H100 can answer while no H200 starts.
#   bash benchmarks/gpu_twentyeighth.sh h100   # an H100, nothing carried, ~5 min (call 1)
#   bash benchmarks/gpu_twentyeighth.sh h200   # an H200 (needs_h200: deepseek's 2 layers),
#     .whl/megatron carried, ~7 min: the GPU tests of the batched copy, the refit and the
#     one-sided transports; the shape matrix with megatron-core side by side (the tile index
#     has not run on an H200); question 2 at deepseek's 2 layers, where its memcpy nodes took
#     1.014-1.020x on an H200, once each
#   bash benchmarks/gpu_twentyeighth.sh moe    # an H200 (needs_h200), nothing carried, ~3 min:
#     the MoE presets' toy rows (every and manual) and question 2 at deepseek's 2 layers
# 1. Does the views check's prefetch help on a GPU host? watch_check_lab.py on
#    qwen3-30b-a3b's toy (8 layers, 4182 views), with benchmarks/patches/views_prefetch.patch
#    applied (fc1d338's prefetch; its own native build: the source is its key) against
#    without, alternating, twice each; the *_after_wait_us figures are the ones that count.
#    (Call 1 ran at 118c8b0, whose main had the prefetch and whose script reverted the patch
#    for "none"; main dropped the prefetch after it, and the script now applies the patch
#    for "prefetch": the same two trees.)
# 2. Would the batched copy beat memcpy nodes on large copies too? The toy matrix rows of
#    deepseek-v3-moe (1 layer: two models of 2 fit 80 GB no more), llama-8b and gpt-4b, whose
#    copies (16-1000 MB) auto leaves as memcpy graph nodes, against the same with every copy
#    batched (--batched: TORCHREFIT_BATCHED_COPY=1), alternating, twice each.
# Results and log in $OUT.
source benchmarks/_h200_run.sh
h200_run twentyeighth
h200_card

# `lab TAG [PYTHONPATH]`: watch_check_lab on qwen3's toy; its after-wait figures
lab() {
  local tag=$1 path=${2:-$PWD/src}
  PYTHONPATH="$path" timeout 120 python3 benchmarks/watch_check_lab.py --preset qwen3-30b-a3b --layers 8 \
    --json "$R/watch_qwen3_$tag.json" 2>&1 | tail -1 | tr ' ' '\n' \
    | grep -E "after_wait|matrix_(warm|cold)|^native_views_us|anon_huge" | tr "\n" " "
  echo " [$tag]"
}

# `large TAG LAYERS [shape_matrix.py args]`: the toy rows of the presets made of large
# copies, deepseek-v3-moe at LAYERS layers
large() {
  local tag=$1 layers=$2
  shift 2
  timeout 150 python3 benchmarks/shape_matrix.py --no-megatron --layers "deepseek-v3-moe=$layers" --only deepseek-v3-moe \
    --only llama-8b --only gpt-4b "$@" --json "$R/large_$tag.json" 2>&1 | grep -E "torchrefit .* floor|Error"
}

case ${1:-h100} in
  h100)
    DIR=$(h200_patched_tree benchmarks/patches/views_prefetch.patch) || exit 1
    PYTHONPATH="$DIR/src" python3 -m torchrefit native build >/dev/null && echo "native built with prefetch"
    echo "=== 1. views check, prefetch or not ($(date +%T))"
    for round in 1 2; do
      lab "prefetch_$round" "$DIR/src"
      lab "none_$round"
    done
    echo "=== 2. large copies, memcpy nodes or batched ($(date +%T))"
    for round in 1 2; do
      large "auto_$round" 1
      large "batched_$round" 1 --batched
    done ;;
  h200)
    h200_with_megatron || echo "megatron-core not carried: toy models only"
    echo "=== 1. GPU tests ($(date +%T))"
    h200_gpu_tests
    echo "=== 2. shape matrix ($(date +%T))"
    h200_matrix 330 h200_shape_matrix.json
    echo "=== 3. large copies, memcpy nodes or batched ($(date +%T))"
    large auto_h200 2
    large batched_h200 2 --batched ;;
  moe)
    echo "=== 1. MoE toy rows ($(date +%T))"
    h200_matrix 200 h200_moe_rows.json --no-megatron --only qwen3-30b-a3b --only deepseek-v3-moe
    echo "=== 2. large copies, memcpy nodes or batched ($(date +%T))"
    large auto_h200 2
    large batched_h200 2 --batched ;;
  *) echo "unknown mode: $1"; exit 2 ;;
esac
echo "=== done ($(date +%T))"

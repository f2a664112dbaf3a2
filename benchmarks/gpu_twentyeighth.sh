#!/usr/bin/env bash
# Twenty-eighth session: two questions the H100 can answer while no H200 starts.
#   bash benchmarks/gpu_twentyeighth.sh h100   # an H100, nothing carried, ~5 min
# 1. Does the views check's prefetch (fc1d338) help on a GPU host? watch_check_lab.py on
#    qwen3-30b-a3b's toy (8 layers, 4182 views), main against main with
#    benchmarks/patches/views_prefetch.patch reverted (its own native build: the source is
#    its key), alternating, twice each; the *_after_wait_us figures are the ones that count.
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

# `large TAG [shape_matrix.py args]`: the toy rows of the presets made of large copies
large() {
  local tag=$1
  shift
  timeout 150 python3 benchmarks/shape_matrix.py --no-megatron --layers deepseek-v3-moe=1 --only deepseek-v3-moe \
    --only llama-8b --only gpt-4b "$@" --json "$R/large_$tag.json" 2>&1 | grep -E "torchrefit .* floor|Error"
}

case ${1:-h100} in
  h100)
    DIR=$(h200_patched_tree benchmarks/patches/views_prefetch.patch -R) || exit 1
    PYTHONPATH="$DIR/src" python3 -m torchrefit native build >/dev/null && echo "native built without prefetch"
    echo "=== 1. views check, prefetch or not ($(date +%T))"
    for round in 1 2; do
      lab "prefetch_$round"
      lab "none_$round" "$DIR/src"
    done
    echo "=== 2. large copies, memcpy nodes or batched ($(date +%T))"
    for round in 1 2; do
      large "auto_$round"
      large "batched_$round" --batched
    done ;;
  *) echo "unknown mode: $1"; exit 2 ;;
esac
echo "=== done ($(date +%T))"

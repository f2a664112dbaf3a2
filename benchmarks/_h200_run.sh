# Sourced by a benchmarks/h200_*.sh call script: `h200_run NAME` makes the results folder
# ($OUT, else benchmarks/results/h200/NAME) as $R, puts src/ on PYTHONPATH, sends all
# output to $R/h200_NAME.log as well, and compiles src once (not inside timed runs).
h200_run() {
  set -u
  R=${OUT:-benchmarks/results/h200/$1}
  mkdir -p "$R"
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
  exec > >(tee -a "$R/h200_$1.log") 2>&1
  python3 -m compileall -q src >/dev/null
}

# `h200_broken_stale_read VAR [pytest args]`: the GPU stale-read test with the wait that
# TORCHREFIT_BREAK_<VAR>=1 removes (PRODUCER_WAIT, DONE_WAIT); its cases must FAIL.
h200_broken_stale_read() {
  local var=$1
  shift
  env "TORCHREFIT_BREAK_$var=1" timeout 120 python3 -m pytest -q -p no:cacheprovider "$@" \
    tests/test_gpu_stale_read.py --timeout 60 2>&1 | grep -E "^FAILED|passed|failed" | tail -16
}

# `h200_with_megatron`: megatron-core importable from .whl/megatron (carried); false where
# it was not carried.
h200_with_megatron() {
  ls .whl/megatron/*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore .whl/megatron/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/mcore
}

# `h200_with_nixl`: nixl-cu13 importable from .whl/nixl (carried alone: 59 MB); false
# where the wheel was not carried.
h200_with_nixl() {
  ls .whl/nixl/*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nixl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}

# `DIR=$(h200_patched_tree PATCH [-R]) || exit 1`: a copy of src/ and benchmarks/ in a new
# folder with PATCH applied (-R: reverted) and compiled; prints the folder. Fails where
# the patch does not apply, leaving the checkout as it is.
h200_patched_tree() {
  local patch=$1 reverse=${2:-} dir
  dir=$(mktemp -d)
  cp -r src benchmarks "$dir"/
  (cd "$dir" && (git apply $reverse "$patch" 2>/dev/null || patch $reverse -p1 < "$patch")) >&2 || return 1
  python3 -m compileall -q "$dir/src" >/dev/null
  echo "$dir"
}

# `h200_card`: which card and driver this call got, whether the native checks built, and
# the tree's commit (the log's first lines).
h200_card() {
  nvidia-smi -q | grep -iE "product name|driver version" | sed 's/  */ /g'
  python3 -m torchrefit native build >/dev/null && echo "native built" || echo "not built"
  echo "main at $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
}

# `h200_ipc_bench LAYOUT [ROUND]`: issue 10's ipc refit of the seed's model in one layout
# (noncolloc2: TP1 -> TP1 non-collocated, 2 processes; colloc2 / colloc4: TP2 -> TP1
# collocated, 2 / 4 processes), its result line; JSON in $R/LAYOUT[_ROUND].json.
h200_ipc_bench() {
  local layout=$1 args limit=60
  case $layout in
    noncolloc2) args="--mode non-collocated --nproc 2" ;;
    colloc2) args="--src tp2 --dst tp1 --nproc 2" ;;
    colloc4) args="--src tp2 --dst tp1 --nproc 4" limit=90 ;;
    *) echo "unknown ipc layout: $layout"; return 2 ;;
  esac
  timeout "$limit" python3 -m torchrefit bench --model gpt-4b --variant graph --warmup 3 --iters 20 \
    --transport ipc $args --label "$layout" --json "$R/$layout${2:+_$2}.json" 2>&1 | tail -1
}

# `h200_gpu_tests`: the GPU tests of the batched copy, the refit and the one-sided
# transports, their summary lines
h200_gpu_tests() {
  timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_batched.py tests/test_gpu_refit.py \
    tests/test_gpu_one_sided.py --timeout 120 2>&1 | tail -3
}

# `h200_matrix LIMIT FILE [shape_matrix.py args]`: the shape matrix with watch="manual" rows
# too, its result lines; JSON in $R/FILE
h200_matrix() {
  local limit=$1 file=$2
  shift 2
  timeout "$limit" python3 benchmarks/shape_matrix.py --watch-manual-too "$@" --json "$R/$file" 2>&1 \
    | grep -E "torchrefit .* floor|Error"
}

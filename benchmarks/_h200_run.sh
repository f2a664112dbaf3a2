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

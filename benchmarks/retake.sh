#!/usr/bin/env bash
# Retake the figures of BENCHMARKS.md on this machine, one run each, into benchmarks/results/:
#   bash benchmarks/retake.sh [sim|plan|run|collectives|cpu|refit|recorder|compression|logs|all]
# Each command is printed before its output; the files are what BENCHMARKS.md quotes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MPI=.venv/bin/mpiexec
OUT=benchmarks/results
mkdir -p "$OUT"
what=${1:-all}

run() {      # name, command...
  local name=$1; shift
  echo "\$ $*" > "$OUT/$name.txt"
  echo "== $name: $*"
  "$@" >> "$OUT/$name.txt" 2>&1
  echo "   exit $? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-100))"
}

case $what in sim|all) run bench_sim .venv/bin/meshcomm bench sim --topology p3.8xlarge ;; esac
case $what in plan|all) run bench_plan .venv/bin/meshcomm bench plan ;; esac
case $what in run|all) run bench_run .venv/bin/meshcomm bench run --procs 8 --size-mb 16 --repeats 9 \
    --backends mpi,torch,mixed --no-jax --json "$OUT/bench_run.json" ;; esac
case $what in collectives|all) run collectives_8 $MPI -n 8 $PY benchmarks/collectives.py --sizes 1K,16K,64K,4M --reps 7 \
    --impls "mpi4py,program[mpi],eager[mpi]"
  run collectives_8_loop $MPI -n 8 $PY benchmarks/collectives.py --sizes 1K,16K,64K,4M --reps 5 --calls 50 \
    --impls "mpi4py,program[mpi],eager[mpi]"
  run persistent_2 $MPI -n 2 $PY benchmarks/persistent.py --sizes 1K,16K,64K
  run bcast_p2p_8 $MPI -n 8 $PY benchmarks/bcast_p2p.py
  run torch_tiles_8 $MPI -n 8 $PY benchmarks/torch_tiles.py ;; esac
case $what in cpu|all) run program_cpu_2 $MPI -n 2 $PY benchmarks/program_cpu.py
  run eager_cpu_2 $MPI -n 2 $PY benchmarks/eager_cpu.py
  run run_path_cost_8 $MPI -n 8 $PY benchmarks/run_path_cost.py
  run lean_steps_8 $MPI -n 8 $PY benchmarks/lean_steps.py ;; esac
case $what in recorder|all) run recorder_cost_2 $MPI -n 2 $PY benchmarks/recorder_cost.py --calls 2000 --rounds 11 ;; esac
case $what in refit|all)
  run bench_refit .venv/bin/meshcomm bench refit --json "$OUT/bench_refit.json"
  run rl_refit_8 $MPI -n 8 $PY examples/rl_refit.py --check --d 256 --layers 4 --repeats 5 --steps 2 ;; esac
case $what in compression|all)      # ~9 minutes: ZFP collectives on emulated links, then the error
  run compression_sizes_8 $MPI -n 8 $PY benchmarks/compression.py sizes
  run compression_crossover_8 $MPI -n 8 $PY benchmarks/compression.py crossover --reps 5
  run compression_error $PY benchmarks/compression.py error ;; esac
case $what in logs|all)             # the examples' communication logs against meshcomm.model
  for ex in pipelined_gpt dlrm moe; do
    rm -rf "out/logs/$ex"
    run "log_$ex" $MPI -n 4 $PY examples/$ex.py --log "out/logs/$ex" --steps 5
    run "log_summary_$ex" .venv/bin/meshcomm log summary "out/logs/$ex" --by tag
  done ;; esac

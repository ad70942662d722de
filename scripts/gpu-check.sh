#!/usr/bin/env bash
# gpu-check.sh: on a machine with an NVIDIA GPU, run what the project's CPU machine cannot,
# and write one Markdown report.
#
#   bash scripts/gpu-check.sh [--only STEP,...] [REPORT]
#
# REPORT defaults to $OUT/gpu-check-report.md where $OUT is set, else ./gpu-check-report.md;
# the benchmarks' JSON files go beside it. The steps (each with its own time limit; a step
# that fails is recorded and the others still run):
#   tests               pytest -m cuda -v: every test marked cuda
#   collectives-cuda    plait bench collectives --device cuda: NCCL's allreduce vs plait's
#                       algorithms over NCCL point-to-point vs staged through host memory,
#                       with --calibrate (a CUDA calibration, kept in the report's folder)
#   train-cuda          plait bench train --device cuda: plait DataParallel vs DDP over NCCL
#   collectives-cpu-8   plait bench collectives -n 8 (CPU tensors)
#   collectives-cpu-16  plait bench collectives -n 16 (CPU tensors)
#   many-ranks          pytest tests/world/test_many_ranks.py: 16 ranks on one host, every collective
# About 10-15 minutes on a 16-core H100 machine, 28 at the time limits. Where one command
# may run 10 minutes at most, split the steps over calls with --only (e.g. `--only tests`,
# then `--only collectives-cuda,train-cuda`, then the CPU steps), one report each.
#
# GPUs: the CUDA steps use 2 ranks on a machine with one GPU (sharing it: PLAIT_SHARE_GPU=1),
# else one rank per GPU (8 at most). Two ranks on one GPU need NCCL >= 2.30 (with
# NCCL_MULTI_RANK_GPU_ENABLE=1, which the benchmarks and tests set); with an older NCCL the
# NCCL rows and tests are skipped, and the report says so.
#
# Python: it needs a torch built with CUDA and plait's dependencies. It uses, in order:
# $PLAIT_PYTHON; .venv/bin/python if its torch sees a GPU; python3 if its torch sees a GPU
# and it has plait's dependencies. Else it sets .venv up as scripts/setup.sh does, and where
# that leaves a CPU-only torch (setup.sh pins torch==2.13.0, which a CPU build satisfies) it
# installs torch==2.13.0 again from the default index, which on Linux x86-64 (PyPI) is the
# CUDA build ($TORCH_INDEX_URL overrides it, e.g. https://download.pytorch.org/whl/cu128).
# That needs the network. plait itself always comes from this checkout (PYTHONPATH=src).
#
# Where no GPU is visible (nvidia-smi missing, or listing none) it refuses at once, before
# installing or running anything: a message and exit status 3. GPU_CHECK_DRY_RUN=1 prints
# the steps' commands instead of running them (no GPU needed, nothing installed or written).
# Exit status: 0 when every step passed, 1 when one failed, 2 for bad arguments, 3 without a
# GPU (or a torch that sees it), 4 when no Python with a CUDA torch could be set up.
set -uo pipefail  # not -e: a failed step is recorded, and the next one runs
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${GPU_CHECK_DRY_RUN:-0}
ALL_STEPS="tests,collectives-cuda,train-cuda,collectives-cpu-8,collectives-cpu-16,many-ranks"
ONLY=$ALL_STEPS
REPORT=""
while [ $# -gt 0 ]; do
    case $1 in
        --only) ONLY=${2:-}; shift 2 ;;
        --only=*) ONLY=${1#--only=}; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) REPORT=$1; shift ;;
    esac
done
for step in ${ONLY//,/ }; do
    case ",$ALL_STEPS," in
        *",$step,"*) ;;
        *) echo "gpu-check: unknown step '$step'; the steps: $ALL_STEPS" >&2; exit 2 ;;
    esac
done
if [ -z "$REPORT" ]; then
    REPORT=${OUT:+$OUT/gpu-check-report.md}
    REPORT=${REPORT:-$ROOT/gpu-check-report.md}
fi

refuse() {
    echo "gpu-check: $*" >&2
    echo "gpu-check: this script runs on a machine with an NVIDIA GPU; nothing was installed" \
        "or run. On a CPU machine use scripts/test.sh." >&2
    exit 3
}
no_python() {
    echo "gpu-check: $*; point PLAIT_PYTHON at a Python whose torch has CUDA" >&2
    exit 4
}

# ------------------------------------------------------------ a GPU, before anything else
GPUS=1
if [ "$DRY" != 1 ]; then
    command -v nvidia-smi >/dev/null 2>&1 || refuse "no GPU here: nvidia-smi is not installed"
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU [0-9]')
    [ "${GPUS:-0}" -ge 1 ] || refuse "no GPU here: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -1))"
fi

# ------------------------------------------------------------------------------- Python
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_deps() { "$1" -c 'import numpy, rich, zmq, msgpack, pytest, pytest_timeout' >/dev/null 2>&1; }
PY=""
if [ "$DRY" = 1 ]; then
    PY=${PLAIT_PYTHON:-.venv/bin/python}
elif [ -n "${PLAIT_PYTHON:-}" ]; then
    PY=$PLAIT_PYTHON
elif [ -x .venv/bin/python ] && sees_gpu .venv/bin/python && has_deps .venv/bin/python; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null 2>&1 && sees_gpu python3 && has_deps python3; then
    PY=python3
else
    echo "gpu-check: no Python with a CUDA torch and plait's dependencies: setting up .venv"
    bash scripts/setup.sh || no_python "scripts/setup.sh failed (no network?)"
    if ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
        echo "gpu-check: .venv has a CPU-only torch: installing torch==2.13.0 (CUDA build)"
        .venv/bin/python -m pip uninstall --quiet -y torch
        .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
            ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
            || no_python "could not install a CUDA torch (no network?)"
    fi
    PY=.venv/bin/python
fi
if [ "$DRY" != 1 ]; then
    sees_gpu "$PY" || refuse "$PY's torch sees no GPU although nvidia-smi lists $GPUS" \
        "($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1))"
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
fi

# --------------------------------------------------------------------------------- steps
RANKS=$(( GPUS >= 2 ? (GPUS < 8 ? GPUS : 8) : 2 ))  # with one GPU, 2 ranks share it
DIR=$(dirname "$REPORT")
WORK=""
if [ "$DRY" != 1 ]; then
    mkdir -p "$DIR"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
CUDA_ENV=(env PLAIT_SHARE_GPU=1 PLAIT_CALIBRATION="$DIR/gpu-check-calibration.json")
CALIBRATE=(--calibrate)
NCCL_NOTE=""
if [ "$DRY" != 1 ]; then
    NCCL_NOTE=$("$PY" -c "from plait.devices import nccl_problem; print(nccl_problem($RANKS) or '')")
    [ -z "$NCCL_NOTE" ] || CALIBRATE=()  # the calibration weighs the NCCL rows
fi

declare -a NAMES=() RESULTS=() TIMES=() COMMANDS=()
FAILED=0
step() {  # step NAME LIMIT_S COMMAND...: run it if selected, log it, record the outcome
    local name=$1 limit=$2
    shift 2
    case ",$ONLY," in *",$name,"*) ;; *) return ;; esac
    echo "== $name: $*"
    [ "$DRY" = 1 ] && return
    local start=$SECONDS rc
    timeout --kill-after=30 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    local result="passed"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        result="timed out after ${limit} s"
    elif [ $rc -ne 0 ]; then
        result="failed (exit $rc)"
    fi
    [ "$result" = passed ] || FAILED=1
    NAMES+=("$name"); RESULTS+=("$result"); TIMES+=($((SECONDS - start))); COMMANDS+=("$*")
    echo "   $result in $((SECONDS - start)) s"
}

step tests 600 "$PY" -m pytest -m cuda -v -rs -p no:cacheprovider tests
step collectives-cuda 240 "${CUDA_ENV[@]}" "$PY" -m plait bench collectives --device cuda \
    -n "$RANKS" --sizes 64K,1M,16M,64M --repeats 5 --budget 2 ${CALIBRATE[@]+"${CALIBRATE[@]}"} --markdown \
    --json "$DIR/gpu-check-collectives-cuda.json"
step train-cuda 240 "${CUDA_ENV[@]}" "$PY" -m plait bench train --device cuda \
    --nproc "$RANKS" --global-batch $((16 * RANKS)) --steps 10 --repeats 3 --markdown \
    --json "$DIR/gpu-check-train-cuda.json"
step collectives-cpu-8 150 "$PY" -m plait bench collectives -n 8 --sizes 4K,64K,1M,16M \
    --repeats 5 --budget 2 --markdown --json "$DIR/gpu-check-collectives-cpu-8.json"
step collectives-cpu-16 210 "$PY" -m plait bench collectives -n 16 --sizes 4K,64K,1M,16M \
    --repeats 5 --budget 2 --markdown --json "$DIR/gpu-check-collectives-cpu-16.json"
step many-ranks 240 "$PY" -m pytest -v -rs -p no:cacheprovider tests/world/test_many_ranks.py
[ "$DRY" = 1 ] && exit 0

# ------------------------------------------------------------------------------- report
{
    echo "# plait GPU check"
    echo
    echo "Written by scripts/gpu-check.sh on $(hostname) at $(date -u '+%Y-%m-%d %H:%M UTC')."
    echo "Commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ', with uncommitted changes')."
    echo
    echo "## Machine"
    echo
    echo '```text'
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
    echo "CPU cores: $(nproc)"
    "$PY" -c 'import sys, torch; from plait.devices import nccl_version as v
print("Python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, v() or ())) or "none", "| GPUs visible", torch.cuda.device_count())' 2>&1
    echo "CUDA steps: $RANKS ranks$( [ "$GPUS" -lt 2 ] && echo ", sharing one GPU")"
    [ -z "$NCCL_NOTE" ] || echo "NCCL cannot join them: $NCCL_NOTE (NCCL rows and tests skipped)"
    echo '```'
    echo
    echo "## Summary"
    echo
    echo "| step | result | seconds | command |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${TIMES[$i]} | \`${COMMANDS[$i]//|/\\|}\` |"
    done
    for i in "${!NAMES[@]}"; do
        echo
        echo "## ${NAMES[$i]}: ${RESULTS[$i]}"
        echo
        echo '```text'
        tail -n 400 "$WORK/${NAMES[$i]}.log"
        echo '```'
    done
} >"$REPORT"
echo "gpu-check: report written to $REPORT"
exit $FAILED

#!/usr/bin/env bash
# The GPU checks in one go, on a machine with CUDA and flasync's dependencies installed:
#   1. the CUDA tests (tests/test_cohort.py, tests/test_edge.py -k cuda);
#   2. vectorized cohorts on the GPU against the CPU plain loop and one client at a time on the GPU, and the whole
#      engine on the GPU with where its time goes (benchmarks/cohort.py --device cuda --engine --phases), at 16, 100
#      and 1,000 clients a round (16: a small round, which `executor.kind = "auto"` trains as a cohort on a GPU and
#      on the threads on a CPU; the engine's threads against its cohorts there check that rule);
#   3. a tracked `flasync run` on the GPU: the GPUs its profile read through pynvml, and the GPU series of MLflow's
#      system monitor;
#   4. the whole test suite with CUDA present, each failure named as it happens (and in OUT/junit.xml at the end).
#
#   bash benchmarks/gpu.sh [OUT]        OUT: where the logs, the run's profile.json and junit.xml go (default: ./gpu-check)
#   PYTHON=python3 SUITE=0 bash benchmarks/gpu.sh     another interpreter; skip the whole suite
#
# Each step runs whatever the one before gave; the exit status is the number of steps that failed.
set -u
out=$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)
python=${PYTHON:-python}
export PYTHONUNBUFFERED=1
failed=0
began=$(date +%s)
step() { echo "=== [$(($(date +%s) - began)) s] $*"; }

if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu.sh: no CUDA device is visible to $python (torch.cuda.is_available() is False)" >&2
    exit 2
fi
"$python" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))"

step "CUDA tests"
"$python" -m pytest -p no:cacheprovider -q -rs tests/test_cohort.py tests/test_edge.py -k "cuda or CUDA" \
    2>&1 | tee "$out/cuda_tests.log" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

step "throughput: vectorized cohorts and the engine on the GPU"
"$python" benchmarks/cohort.py --device cuda --clients 16 100 1000 --repeats 3 --max-cohort 1000 --engine --phases \
    2>&1 | tee "$out/throughput.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

step "a tracked run on the GPU"
# The store and its artifacts go to a scratch folder: OUT keeps the logs (a machine that sends OUT back may limit
# how many files come); the run's profile.json is copied there.
scratch=$(mktemp -d)
store="sqlite:///$scratch/mlflow.db"
if "$python" -m flasync run --tracking-uri "$store" --set executor.device=cuda >"$out/run.log" 2>&1; then
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false "$python" - "$store" "$scratch" <<'PY' || failed=$((failed + 1))
import json
import sys

from mlflow.tracking import MlflowClient

client = MlflowClient(sys.argv[1])
run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
series = sorted(key for key in run.data.metrics if key.startswith("system/gpu"))
profile = json.loads(open(client.download_artifacts(run.info.run_id, "profile.json", sys.argv[2])).read())
gpus = profile["memory"].get("gpus") or []
print(f"run {run.info.run_id}: {run.info.status}, accuracy {run.data.metrics.get('server/eval/accuracy')}")
print("GPUs in profile.json (pynvml, at the end):", json.dumps(gpus))
print("system monitor's GPU series:", ", ".join(series) or "none (a run shorter than its sampling interval)")
sys.exit(0 if run.info.status == "FINISHED" and gpus else 1)
PY
else
    tail -5 "$out/run.log"
    failed=$((failed + 1))
fi
cp "$scratch/profile.json" "$out/" 2>/dev/null
rm -rf "$scratch"

if [ "${SUITE:-1}" != 0 ]; then
    step "the whole suite with CUDA present"
    parallel=()
    if "$python" -c "import xdist" 2>/dev/null; then
        parallel=(-n auto)
    fi
    # -v: each test's outcome is in the log as it happens, so a run cut short still names its failures.
    "$python" -m pytest -p no:cacheprovider -v -rfE "${parallel[@]}" --junitxml="$out/junit.xml" \
        >"$out/suite.log" 2>&1 || failed=$((failed + 1))
    grep -E "(FAILED|ERROR) tests/|tests/.* (FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/suite.log" | sort -u | tail -40
fi

step "done: $failed step(s) failed; logs in $out"
exit "$failed"

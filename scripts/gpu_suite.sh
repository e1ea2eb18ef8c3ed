#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for a lent multi-GPU machine (no package
# registry there: run from the source tree; missing test plugins come as wheels in .whl/).
#   scripts/gpu_suite.sh [all|core|tests|smoke|bench|train|faults|doctor|profile|bench8|buckets|sweep|torch|quick|verify|reducer|ddp|embed|agree|rows4|tags|session|percall|pertable|capture|checkcost]...
#   scripts/gpu_suite.sh step36   (only when named) issue 36's GPU tests and bench_ddp --overlap-step
#   scripts/gpu_suite.sh rehearsal   (only when named; root) the two-host rehearsal, GPUs split
#                                    between two namespace hosts: scripts/gpu_cluster_rehearsal.sh
#   scripts/gpu_suite.sh rehearsal-bind   (only when named; root) its hosts' doctor --net with Open
#                                    MPI's default binding, then with --bind-to none
# Writes gpu_log.txt (everything), gpu_summary.txt (one line per step) and the bench
# JSON/plots under $OUT (default ./out); the rehearsal its own files in $OUT/rehearsal.
# NCCL_NVLS_ENABLE=0 stays set for every child.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
PY=$(command -v "$PY") || { echo "gpu_suite.sh: no interpreter ${PY}" >&2; exit 1; }   # (absolute: the rehearsal's hosts have another PATH)
if ! "$PY" -c "import pytest_mpi, pytest_timeout, ml_dtypes" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        $(ls .whl/pytest_mpi-*.whl .whl/pytest_timeout-*.whl .whl/ml_dtypes-*.whl 2>/dev/null) >/dev/null 2>&1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MPIRUN=${MPIRUN:-mpirun}
LOG=$OUT/gpu_log.txt
export MPICOMM_GRAD_SHAPES=${MPICOMM_GRAD_SHAPES:-}  # empty: the ResNet-50 set shipped with mpicomm
RES=$OUT/res   # JSON and extra plots, packed into results.tgz at the end (few files come back)
mkdir -p "$RES"
SUM=$OUT/gpu_summary.txt
MPI=("$MPIRUN" --allow-run-as-root --oversubscribe -x PYTHONPATH -x NCCL_NVLS_ENABLE
     -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x MPICOMM_GRAD_SHAPES -n)
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "======== $name: $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUM"
}
{
    echo "date: $(date -u +%FT%TZ)"; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
    "$PY" -c "import sys, numpy, cupy, mpi4py; from mpi4py import MPI; from cupy.cuda import nccl
print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)
print('nccl', nccl.get_version(), '|', MPI.Get_library_version().splitlines()[0])
try:
    import torch; print('torch', torch.__version__)
except Exception as e: print('torch missing', e)
for m in ('sklearn', 'matplotlib', 'ml_dtypes', 'pytest_mpi'):
    try: print(m, __import__(m).__version__)
    except Exception as e: print(m, 'missing', e)"
} >>"$OUT/gpu_summary.txt" 2>&1
# the compiled call path (mpicomm/_native), built in place for this interpreter
step "native-build" 60 "$PY" -m mpicomm._native
"$PY" -c "import mpicomm._native as n; print('compiled call path in use:', n.active(), n.why_not or '')" >>"$SUM" 2>&1
PYT=("$PY" -m pytest -q -p no:cacheprovider --color=no --with-mpi -m "mpi")
bench_ddp() {  # bench_ddp ROUNDS LIMIT_S [ARGS]: scripts/bench_ddp.py at 4 and 2 GPUs, its tables into the summary
    local g r=$1 limit=$2
    shift 2
    for g in 4 2; do
        [ "$NGPU" -ge "$g" ] || continue
        step "bench-ddp-np$g" "$limit" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((g - 1)))" "${MPI[@]}" "$g" \
            -x CUDA_VISIBLE_DEVICES "$PY" scripts/bench_ddp.py --rounds "$r" --json "$RES/bench_ddp_np$g.json" "$@"
        grep -a -A8 "^# bench_ddp: $g x" "$LOG" | tail -9 >>"$SUM"
    done
}
want() { [ "$#" = 0 ] && return 0; for w in "${SECTIONS[@]}"; do [ "$w" = all ] || [ "$w" = "$1" ] && return 0; done; return 1; }
SECTIONS=("${@:-all}")

if want core || want tests; then
    step "gpu-tests-np$NGPU" 500 "${MPI[@]}" "$NGPU" "${PYT[@]}" -x tests/test_gpu.py tests/test_collectives.py tests/test_api.py
    step "gpu-staged-on-mpi-np$NGPU" 200 env MPICOMM_BACKEND=mpi "${MPI[@]}" "$NGPU" -x MPICOMM_BACKEND "${PYT[@]}" tests/test_gpu.py -k staged
fi
if want core || want tests || want tags; then  # tags on GPU arrays (issue 27), and their host side on the CPU
    step "gpu-tags-np$NGPU" 200 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_gpu_tags.py tests/test_p2p_tags.py \
        tests/test_gpu_uneven.py tests/test_gpu.py -k "tag or p2p or send"
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
fi
if want quick; then  # every GPU test file, then the DDP comparison at 4 and 2 GPUs (a short device budget)
    step "gpu-all-tests-np$NGPU" 130 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_gpu*.py
    bench_ddp 3 110
    step "cpu-torch-tests-np$NGPU" 120 env MPICOMM_BACKEND=mpi "${MPI[@]}" "$NGPU" -x MPICOMM_BACKEND "${PYT[@]}" \
        tests/test_torch.py tests/test_objects.py tests/test_ported.py
fi
if want tests; then
    step "mpi-tests-rest-np$NGPU" 500 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_buckets.py \
        tests/test_train.py tests/test_sampler.py tests/test_context.py tests/test_errors.py tests/test_repeat.py $(ls tests/test_shm.py 2>/dev/null)
fi
if want faults && [ -f tests/test_faults.py ]; then
    step "faults-nccl" 400 "$PY" -m pytest -q -rs -p no:cacheprovider --color=no tests/test_faults.py -k nccl-gpu
fi
if want smoke && "$PY" -c "import mpicomm.tools.smoke" 2>/dev/null; then
    step "smoke-np$NGPU" 300 "${MPI[@]}" "$NGPU" "$PY" -m mpicomm.tools.smoke --backend nccl
fi
if want doctor && [ -f mpicomm/tools/doctor.py ]; then
    step "doctor" 120 "${MPI[@]}" "$NGPU" "$PY" -m mpicomm.tools.doctor
    step "doctor-one-gpu(expect rc=1)" 120 env CUDA_VISIBLE_DEVICES=0 "$PY" -m mpicomm.launch -n 2 -m mpicomm.tools.doctor
fi
if want train && [ -f scripts/train_data_parallel.py ]; then
    step "train-np$NGPU" 300 "${MPI[@]}" "$NGPU" "$PY" scripts/train_data_parallel.py --min-accuracy 0.9
fi
B=("$PY" -m mpicomm.tools.bench --backend nccl --compare)
if want profile || want bench8 || want bench; then  # us per call at 8 bytes, mpicomm against raw
    step "percall-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --json "$RES/percall.json"
    step "percall-fresh-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --fresh --json "$RES/percall_fresh.json"
    step "percall-torch-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --array torch \
        --json "$RES/percall_torch.json"
fi
if want buckets; then
    step "gpu-buckets-tests-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_buckets.py tests/test_train.py
    step "bench-buckets" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets -n 50 -w 5 --rounds 5 \
        --json "$RES/bench_buckets.json"
fi
if want sweep; then  # the large sizes only, where the ">= 98% of raw" target applies
    for c in all_reduce all_gather reduce_scatter broadcast; do
        step "sweep-$c" 200 "${MPI[@]}" "$NGPU" "${B[@]}" --coll "$c" -b 1M -e 1G -f 4 -n 0 --target-time 0.25 \
            -w 5 --rounds 4 --json "$RES/sweep_$c.json"
    done
fi
if want bench && "$PY" -c "import mpicomm.tools.bench" 2>/dev/null; then
    for c in all_reduce all_gather reduce_scatter broadcast; do
        step "bench-$c" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --coll "$c" -b 8 -e 1G -f 2 -n 0 --target-time 0.25 \
            -w 5 --rounds 4 --json "$RES/bench_$c.json" --plot "$OUT/bench_$c.png"
    done
    step "bench-buckets" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets -n 50 -w 5 --rounds 5 \
        --json "$RES/bench_buckets.json" --plot "$RES/bench_buckets.png"
    step "bench-buckets-caps" 300 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets -n 50 -w 5 --rounds 5 --stat median \
        --bucket-cap-mb 25,4,0 --json "$RES/bench_buckets_caps.json"
    for a in fresh torch; do  # new arrays every call; PyTorch CUDA tensors
        opt=(--fresh); [ "$a" = torch ] && opt=(--array torch)
        step "bench-all_reduce-$a" 300 "${MPI[@]}" "$NGPU" "${B[@]}" "${opt[@]}" --coll all_reduce -b 8 -e 1G -f 4 \
            -n 0 --target-time 0.25 -w 5 --rounds 4 --json "$RES/bench_all_reduce_$a.json"
    done
fi
if want torch; then  # mpicomm.torch: CUDA tensors, the DDP comparison at 2 and 4 GPUs, the fused reducer
    step "gpu-torch-tests-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_gpu_torch.py \
        tests/test_fused_reducer.py tests/test_buckets.py
    step "cpu-torch-tests-np$NGPU" 120 env MPICOMM_BACKEND=mpi "${MPI[@]}" "$NGPU" -x MPICOMM_BACKEND "${PYT[@]}" tests/test_torch.py
    step "train-torch-np$NGPU" 120 "${MPI[@]}" "$NGPU" "$PY" scripts/train_torch.py --min-accuracy 0.95 --log-every 1000
    for g in 2 4; do
        [ "$NGPU" -ge "$g" ] || continue
        step "bench-ddp-np$g" 300 env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((g - 1)))" "${MPI[@]}" "$g" \
            -x CUDA_VISIBLE_DEVICES "$PY" scripts/bench_ddp.py --json "$RES/bench_ddp_np$g.json"
        grep -A4 "^# bench_ddp: $g x" "$LOG" | tail -5 >>"$SUM"
    done
    step "bench-buckets-fused-np$NGPU" 200 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets -n 50 -w 5 --rounds 5 \
        --json "$RES/bench_buckets_fused.json"
    grep -E "reducer\(grads\)|reduce_\(grads\)|one buffer" "$LOG" | tail -4 >>"$SUM"
fi
if want verify; then  # the reducer's benchmark (first, on a quiet machine), its GPU tests, the fault matrix's NCCL cases, groups
    for a in cupy torch; do
        step "bench-buckets-$a" 150 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets --array "$a" -n 50 -w 5 --rounds 5 \
            --json "$RES/bench_buckets_$a.json"
        grep -a -E "^ *(buckets|one buffer|per-tensor)" "$LOG" | tail -7 >>"$SUM"
    done
    step "gpu-buckets-tests-np$NGPU" 150 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_buckets.py -k gpu
    grep -a -E "^[0-9]+ passed|failed" "$LOG" | tail -1 >>"$SUM"
    step "faults-nccl" 300 "$PY" -m pytest -q -rs -p no:cacheprovider --color=no tests/test_faults.py -k nccl-gpu
    grep -a -E "passed|failed" "$LOG" | tail -1 >>"$SUM"
    for g in 2 4; do
        [ "$NGPU" -ge "$g" ] || continue
        step "groups-np$g" 150 env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((g - 1)))" "${MPI[@]}" "$g" \
            -x CUDA_VISIBLE_DEVICES "${PYT[@]}" tests/test_groups.py
        grep -a -E "^[0-9]+ passed|failed" "$LOG" | tail -1 >>"$SUM"
    done
fi
if want reducer; then  # reducer(grads): its GPU tests, then its benchmark twice for each array type
    step "gpu-reducer-tests-np$NGPU" 240 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_fused_reducer.py tests/test_buckets.py \
        tests/test_gpu_torch.py tests/test_train.py
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
    for a in cupy torch cupy torch; do
        step "bench-buckets-$a" 150 "${MPI[@]}" "$NGPU" "${B[@]}" --coll buckets --array "$a" -n 50 -w 5 --rounds 5
        grep -a -E "^ *(buckets|one buffer|per-tensor)" "$LOG" | tail -7 >>"$SUM"
    done
fi
if want ddp; then  # the DDP comparison, 5 rounds, at 4 and 2 GPUs
    bench_ddp 5 240
fi
if want embed; then  # the wrapper's and reducer's GPU tests, its CPU tests on MPI, the DDP comparison with the dense-embedding variant
    step "gpu-torch-tests-np$NGPU" 300 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_gpu_torch.py tests/test_fused_reducer.py \
        tests/test_buckets.py tests/test_train.py
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
    step "cpu-torch-tests-np$NGPU" 120 env MPICOMM_BACKEND=mpi "${MPI[@]}" "$NGPU" -x MPICOMM_BACKEND "${PYT[@]}" tests/test_torch.py
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
    step "train-torch-np$NGPU" 120 "${MPI[@]}" "$NGPU" "$PY" scripts/train_torch.py --min-accuracy 0.95 --log-every 1000
    bench_ddp 5 300 --modes none,ddp,mpicomm,mpicomm_dense
fi
if want agree; then  # the agreement check on NCCL: its tests, every GPU test, its cost per call, large sizes
    step "gpu-agreement-tests-np$NGPU" 200 "${MPI[@]}" "$NGPU" "${PYT[@]}" \
        tests/test_gpu_agreement.py tests/test_agreement.py
    grep -a -E "^[0-9]+ (passed|failed)|failed|CollectiveMismatchError: rank" "$LOG" | tail -3 >>"$SUM"
    step "gpu-all-tests-np$NGPU" 200 "${MPI[@]}" "$NGPU" "${PYT[@]}" tests/test_gpu.py tests/test_gpu_inplace.py \
        tests/test_gpu_torch.py tests/test_gpu_uneven.py tests/test_collectives.py
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
    for a in cupy torch; do
        step "percall-check-$a" 120 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --fresh --check-cost --rounds 20 --array "$a" \
            --json "$RES/percall_check_$a.json"
        grep -a -E "^ +(all_reduce|all_gather|reduce_scatter|broadcast) +8 " "$LOG" | tail -11 >>"$SUM"
    done
fi
if want rows4; then  # the 4-GPU rows: agreement tests, per-call cost (CuPy, PyTorch), the DDP comparison
    step "gpu-agreement-tests-np$NGPU" 150 "${MPI[@]}" "$NGPU" "${PYT[@]}" \
        tests/test_gpu_agreement.py tests/test_agreement.py
    grep -a -E "^[0-9]+ (passed|failed)|failed" "$LOG" | tail -1 >>"$SUM"
    for a in cupy torch; do
        step "percall-$a-np$NGPU" 120 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --fresh --check-cost --array "$a" \
            --json "$RES/percall_${a}_np$NGPU.json"
        grep -a -E "^ +(all_reduce|all_gather|reduce_scatter|broadcast) +8 " "$LOG" | tail -11 >>"$SUM"
    done
    step "bench-ddp-np$NGPU" 200 "${MPI[@]}" "$NGPU" "$PY" scripts/bench_ddp.py --rounds 3 --json "$RES/bench_ddp_np$NGPU.json"
    grep -a -A8 "^# bench_ddp: $NGPU x" "$LOG" | tail -9 >>"$SUM"
fi
if want session; then  # a short device budget: every GPU test file, the agreement and reducer tests, graph replay
    step "gpu-tests-np$NGPU" 230 "${MPI[@]}" "$NGPU" "${PYT[@]}" -rfE tests/test_gpu*.py tests/test_agreement.py \
        tests/test_p2p_tags.py tests/test_fused_reducer.py tests/test_buckets.py
    grep -a -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR| failed" "$LOG" | tail -12 >>"$SUM"
    for a in cupy torch; do
        step "bench-capture-$a" 45 "${MPI[@]}" "$NGPU" "$PY" scripts/bench_capture.py --array "$a" --rounds 20
        grep -a -A5 "^# bench_capture: " "$LOG" | tail -6 >>"$SUM"
    done
fi
if want capture; then  # a DDP training step captured in one CUDA graph, replayed and checked
    step "capture-ddp-np2" 120 env CUDA_VISIBLE_DEVICES=0,1 "${MPI[@]}" 2 -x CUDA_VISIBLE_DEVICES "$PY" scripts/capture_ddp.py
    grep -a -E "^# capture_ddp|^# replayed|capture failed|Error" "$LOG" | tail -6 >>"$SUM"
fi
if want checkcost; then  # the agreement check's cost per call, CuPy and PyTorch (the bench's --check-cost)
    for a in cupy torch; do
        step "percall-check-$a" 120 "${MPI[@]}" "$NGPU" "${B[@]}" --percall --fresh --check-cost --rounds 20 --array "$a" \
            --json "$RES/percall_check_$a.json"
        grep -a -E "^ +(all_reduce|all_gather|reduce_scatter|broadcast) +8 " "$LOG" | tail -11 >>"$SUM"
    done
fi
if want pertable; then  # the per-call table (issue 27): 8 B, new arrays, raw in the same run; compiled and Python call path
    for a in cupy torch; do
        for nat in 1 0; do
            step "percall-$a-native$nat" 120 env MPICOMM_NATIVE=$nat "${MPI[@]}" 2 -x MPICOMM_NATIVE "${B[@]}" \
                --percall --fresh --rounds 20 --array "$a" --json "$RES/percall_${a}_native$nat.json"
            grep -a -E "^ +(all_reduce|all_gather|reduce_scatter|broadcast) +8 " "$LOG" | tail -7 >>"$SUM"
        done
    done
fi
if want percall; then  # where a call's time goes (scripts/profile_percall.py), CuPy and PyTorch; BASE=dir: also that tree's mpicomm
    for a in cupy torch; do
        for tree in "$PWD" ${BASE:+"$BASE"}; do
            step "profile-$a-$(basename "$tree")" 150 env PYTHONPATH="$tree:${PYTHONPATH#*:}" "${MPI[@]}" 2 \
                "$PY" scripts/profile_percall.py --array "$a" --rounds 10
            grep -a -A22 "^# profile_percall" "$LOG" | tail -23 >>"$SUM"
        done
    done
    for tree in "$PWD" ${BASE:+"$BASE"}; do   # and the bandwidth at 64 MiB, against raw
        step "bw64M-$(basename "$tree")" 120 env PYTHONPATH="$tree:${PYTHONPATH#*:}" "${MPI[@]}" 2 "$PY" -m mpicomm.tools.bench \
            --backend nccl --compare --coll all_reduce -b 64M -e 64M -n 0 --target-time 0.3 -w 5 --rounds 4
        grep -a -E "^ +all_reduce +67108864 " "$LOG" | tail -2 >>"$SUM"
    done
fi
if [[ " ${SECTIONS[*]} " == *" step36 "* ]]; then  # issue 36 (named only, about 4 min): graph replays watched,
    # the overlapped optimizer step, bench_ddp with it at 4 and 2 GPUs
    step "h36-gpu-tests-np2" 150 env CUDA_VISIBLE_DEVICES=0,1 "${MPI[@]}" 2 -x CUDA_VISIBLE_DEVICES "${PYT[@]}" -rfE \
        tests/test_gpu_capture.py tests/test_gpu_torch.py -k "capture or replay or overlapped"
    grep -a -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR| failed" "$LOG" | tail -6 >>"$SUM"
    step "h36-replay-faults" 120 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m pytest -q -p no:cacheprovider --color=no -rfE \
        tests/test_faults.py -k replay
    grep -a -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR" "$LOG" | tail -4 >>"$SUM"
    bench_ddp 4 150 --steps 15 --warmup 5 --overlap-step
fi
# The rehearsal splits CUDA_VISIBLE_DEVICES' GPUs where it is set, else all of them.
RGPU=$NGPU; [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && RGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
if [[ " ${SECTIONS[*]} " == *" rehearsal "* ]]; then  # named only (not in "all"): it makes network namespaces as root
    # Its summary: cores, MTU, offloads, plain TCP over the veth, the doctor's matrix, one line per step.
    step "rehearsal-gpus$RGPU" 590 env OUT="$OUT/rehearsal" PY="$PY" NGPU="$RGPU" BUDGET_S="${BUDGET_S:-540}" \
        bash scripts/gpu_cluster_rehearsal.sh run
    sed 's/^/    /' "$OUT/rehearsal/cluster_summary.txt" >>"$SUM" 2>/dev/null
fi
if [[ " ${SECTIONS[*]} " == *" rehearsal-bind "* ]]; then  # named only: the rehearsal's hosts, doctor --net with Open MPI's default binding, then --bind-to none
    R=scripts/gpu_cluster_rehearsal.sh
    if H=$(PER_HOST=$((RGPU / 2 > 0 ? RGPU / 2 : 2)) NGPU="$RGPU" PY="$PY" bash "$R" up 2>>"$LOG" | tail -1) && [ -f "$H" ]; then
        bash "$R" exec gpuhost1 "$PY" scripts/tcp_probe.py facts mpc0 >>"$SUM" 2>&1
        for b in default none; do
            bind=(); [ "$b" = none ] && bind=(--bind-to none)
            at=$(wc -l <"$LOG")
            step "rehearsal-doctor-net-bind-$b" 150 bash "$R" exec gpuhost1 "$PY" -m mpicomm.launch --hostfile "$H" \
                -n $(($(grep -c slots= "$H") * $(grep -o 'slots=[0-9]*' "$H" | head -1 | cut -d= -f2))) "${bind[@]}" \
                --timeout 140 "$(dirname "$H")/host_gpus" "$PY" -m mpi4py -m mpicomm.tools.doctor --net
            tail -n +$((at + 1)) "$LOG" | grep -a -A6 '^network: ' | grep -a -E '^(host a|gpuhost)' | sed 's/^/    /' >>"$SUM"
            tail -n +$((at + 1)) "$LOG" | grep -a '^warning: ranks .* bound to CPU' | cut -c1-160 | sed 's/^/    /' >>"$SUM"
        done
        bash "$R" down
    else
        echo "rehearsal-bind: the hosts did not come up; see $LOG" | tee -a "$SUM"
    fi
fi
(cd "$RES" && tar czf "$OUT/results.tgz" . ) && rm -rf "$RES"
echo "done" >>"$SUM"

#!/usr/bin/env bash
# One call on a lent GPU (about 9 minutes) for issues 27 and 28:
#   1. on a quiet GPU: triton without score modifiers at BASELINE (the commit before the modifiers) and here,
#      then softcap and ALiBi (benchmarks/gpu_kernels.py, N=32K, D=64, bf16), then BASELINE once more (spread);
#   2. at once: the Triton tests on the GPU and the ListOps runs (benchmarks/listops.py, 6 at a time).
# Everything lands in $OUT/results.tgz; the summary is printed last.
#
#   git archive 258b69b~1 sparse_attn benchmarks | tar -x -C .gpu_baseline    # here, before the call
#   bash benchmarks/gpu_mods_listops.sh .gpu_baseline                        # there
set -u
BASELINE=$(cd "$1" && pwd)
REPO=$(pwd)
RES=/tmp/results
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
KERNELS=(--n 32768 --head-dim 64 --no-million)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
    > "$RES/gpu.txt"

(cd "$BASELINE" && PYTHONPATH=$BASELINE timeout 85 python benchmarks/gpu_kernels.py "${KERNELS[@]}" \
    --impls triton --budget-s 60 --out "$RES/before") > "$RES/bench.log" 2>&1
PYTHONPATH=$REPO timeout 140 python benchmarks/gpu_kernels.py "${KERNELS[@]}" \
    --impls triton triton-softcap triton-alibi --budget-s 110 --out "$RES/after" >> "$RES/bench.log" 2>&1
(cd "$BASELINE" && PYTHONPATH=$BASELINE timeout 40 python benchmarks/gpu_kernels.py "${KERNELS[@]}" \
    --impls triton --patterns longformer --budget-s 20 --out "$RES/before-again") >> "$RES/bench.log" 2>&1

PYTHONPATH=$REPO timeout 290 python -m pytest -v -rfEs -n 6 --timeout 200 -p no:cacheprovider \
    tests/test_triton_backend.py tests/test_score_mods_triton.py tests/test_nn.py \
    tests/test_compile.py::test_triton_backend_with_a_layout_built_on_the_host > "$RES/pytest.log" 2>&1 &
PYTHONPATH=$REPO timeout 300 python benchmarks/listops.py --recipe lra --steps 2000 --train 64000 --jobs 6 \
    --out "$RES/listops" > "$RES/listops.log" 2>&1 &
wait

tar -czf "$OUT/results.tgz" -C "$RES" .
cat "$RES/gpu.txt"
grep -h -E "^(\||-) (longformer|bigbird|sliding)" "$RES"/before*/gpu_kernels.md "$RES"/after/gpu_kernels.md
grep -E "passed|failed|^FAILED|^ERROR" "$RES/pytest.log" | tail -25
grep -E "^\{|generated|Error|error" "$RES/listops.log" | cut -c1-400 | tail -12

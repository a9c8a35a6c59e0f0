#!/usr/bin/env bash
# One call on a lent GPU (under 10 minutes) for issues 27, 23 (item 9) and 28, from the repository root:
#   1. on a quiet GPU: triton with and without softcap (the hardware tanh for bf16), N=32K, D=64, bf16, the three
#      patterns of benchmarks/gpu_kernels.py; then one decode step (benchmarks/gpu_session.py decode);
#   2. at once: the GPU tests of what changed (-n 4) and ListOps seeds 1 and 2 of the committed recipe, one seed
#      at a time (6 runs each), resuming the committed seed-0 rows so that listops.json holds all three seeds.
# Everything lands in $OUT/results.tgz; the summary is printed last.
#
#   bash benchmarks/gpu_tanh_decode_seeds.sh
set -u
RES=/tmp/results
mkdir -p "$RES/listops"
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
    > "$RES/gpu.txt"

timeout 150 python benchmarks/gpu_kernels.py --n 32768 --head-dim 64 --no-million --impls triton triton-softcap \
    --budget-s 120 --out "$RES/kernels" > "$RES/bench.log" 2>&1
timeout 60 python benchmarks/gpu_session.py decode --out "$RES/decode" >> "$RES/bench.log" 2>&1

timeout 330 python -m pytest -v -rfEs -n 4 --timeout 200 -p no:cacheprovider tests/test_score_mods_triton.py \
    tests/test_triton_backend.py tests/test_compile.py tests/test_kv_cache.py::test_generation_with_the_triton_backend \
    > "$RES/pytest.log" 2>&1 &
LISTOPS=(python benchmarks/listops.py --recipe lra --steps 1200 --train 38400 --jobs 6 --resume --out "$RES/listops")
grep -q "H100 80GB HBM3" "$RES/gpu.txt" && cp benchmarks/results/listops.json "$RES/listops/"
timeout 250 "${LISTOPS[@]}" --seeds 0 1 > "$RES/listops.log" 2>&1
timeout $((560 - SECONDS)) "${LISTOPS[@]}" --seeds 0 1 2 >> "$RES/listops.log" 2>&1
wait

tar -czf "$OUT/results.tgz" -C "$RES" .
cat "$RES/gpu.txt"
grep -h -E "^\| (longformer|bigbird|sliding)" "$RES"/kernels/gpu_kernels.md
grep -h -E "step|SDPA" "$RES"/decode/gpu_decode.txt
grep -E "passed|failed|^FAILED|^ERROR" "$RES/pytest.log" | tail -25
grep -E "^\{|Error|error|exists" "$RES/listops.log" | cut -c1-300 | tail -14
echo "elapsed ${SECONDS} s"

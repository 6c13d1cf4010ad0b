#!/usr/bin/env bash
# Checks lm on the accelerator JAX sees (GPU or TPU), prints one table (check | result | figure |
# tolerance/target) and exits non-zero if any check failed or any step crashed.
#
#   make install && .venv/bin/pip install 'jax[cuda12]==0.10.2'   # GPU host ('jax[tpu]==0.10.2' on a TPU VM)
#   bench/accelerator_check.sh
#   ALLOW_CPU=1 bench/accelerator_check.sh        # no accelerator: everything on CPU, a smoke test
#   QUICK=1 ...                                   # skip step 1, fewer tests in step 2, small shapes
# Environment: PYTHON (default .venv/bin/python), TEST_WORKERS (step 1's pytest workers, default 4),
# ACCEL_TESTS (step 2's test paths), SUITE=0 (skip step 1 only), PEER_PYTHON (a Python with torch and
# transformers for step 5's peer, torch for step 6's; default: PYTHON if it has them).
#
# 1. The whole test suite on this host's CPU, as `make test` runs it. tests/conftest.py sets
#    JAX_PLATFORMS=cpu and 8 simulated devices: the mesh tests need 8 devices, which one accelerator
#    does not have, and many xdist workers must not share one GPU or TPU.
# 2. The model and loss numerics tests again, on the accelerator: JAX_PLATFORMS set but empty, which
#    conftest keeps and jax reads as "pick the accelerator". One process (a TPU admits one), no GPU
#    memory preallocation, and JAX_DEFAULT_MATMUL_PRECISION=highest, since the tests' float32
#    tolerances assume exact float32 matmuls, not TF32. Three tests are left out: two are about XLA:CPU
#    (kernels=auto picking the CPU kernels, the CPU compiler's bf16 residuals), one needs 8 devices.
# 3. Attention: cudnn, xla and blockwise against the reference, on packed documents, kernel and model
#    (bench/accelerator_check.py attention). No cuDNN on TPU or CPU: those rows are skipped, with why.
# 4. Throughput: bench/train_throughput.py's bf16 train step, MFU against the chip's vendor bf16 peak
#    (lm/plan/hardware.py), or against the measured matmul peak when the chip is unknown (the row says so).
# 5. Decode: bench/decode_throughput.py, the engine against the static decoder and transformers'
#    `generate` on the same accelerator (targets: 2x generate, 1x the static decoder; below them the
#    row says "below", not FAIL), then a 1B bf16 model at batch 1, 16 and 64 (target at batch 1: 75%
#    of the memory-bandwidth ceiling).
# 6. MFU: bench/mfu.py, lm's bf16 train step at GPT-2-124M, Llama-3.2-1B and Llama-3-8B-layer shapes
#    against a torch.compile peer in the same rounds (PEER_PYTHON, or PYTHON, with torch); the figure
#    gives each shape's MFU (vendor peak) and lm/peer ratio, and whether the H100/H200 targets are met.
# 7. MoE: bench/moe_step.py, dropless and capacity routing against the dense model of equal active
#    FLOPs (bf16, d_model 1024, 8 layers, 8 experts top-2, 16k tokens a step; target: dropless >= 0.8x).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-.venv/bin/python}
quick=${QUICK:-0}
if [[ ! -x $py ]]; then
    echo "no $py: run 'make install' first (or set PYTHON)" >&2
    exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rows=$work/rows.jsonl
check() { "$py" bench/accelerator_check.py "$@" --rows "$rows"; }
summary() { grep -E '[0-9]+ (passed|failed|error)' "$1" | tail -n 1; }

export JAX_PLATFORMS=  # jax picks the accelerator; conftest keeps a set (even empty) value
platform=$(check probe) || exit $?
[[ $quick == 1 ]] && q=(--quick) || q=()

echo "== 1. test suite on CPU"
if [[ $quick == 1 || ${SUITE:-1} == 0 ]]; then
    check record --check "tests: whole suite (CPU)" --skip --figure "QUICK=1 or SUITE=0"
else
    JAX_PLATFORMS=cpu "$py" -m pytest -q -n "${TEST_WORKERS:-4}" --dist loadfile 2>&1 | tee "$work/suite.log"
    rc=${PIPESTATUS[0]}
    check record --check "tests: whole suite (CPU, 8 simulated devices)" --rc "$rc" \
        --figure "$(summary "$work/suite.log")" --target "all pass"
fi

if [[ -n ${ACCEL_TESTS:-} ]]; then
    read -ra tests <<<"$ACCEL_TESTS"
elif [[ $quick == 1 ]]; then
    tests=(tests/model/test_attention.py tests/model/test_blockwise.py)
else
    tests=(tests/model tests/train/test_losses.py tests/train/test_step.py)
fi
echo "== 2. numerics tests on $platform: ${tests[*]}"
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" -m pytest -q "${tests[@]}" \
    --deselect tests/model/test_kernels.py::test_auto_picks_cpu_kernels_on_cpu \
    --deselect tests/model/test_transformer.py::test_bfloat16_residuals_are_not_stacked_as_float32 \
    --deselect tests/model/test_cache.py::test_cache_shardings_split_batch_and_kv_heads 2>&1 | tee "$work/accel.log"
rc=${PIPESTATUS[0]}
check record --check "tests: numerics on $platform" --rc "$rc" \
    --figure "$(summary "$work/accel.log")" --target "all pass (3 CPU/mesh tests left out)"

for step in attention throughput; do
    echo "== ${step}"
    if ! check "$step" "${q[@]}"; then
        check record --check "$step step" --rc 1 --figure "crashed: see the log above"
    fi
done

echo "== decode"
peer=${PEER_PYTHON:-$py}
if "$peer" -c "import torch, transformers" 2>/dev/null; then
    device=cpu
    [[ $platform == gpu ]] && device=cuda
    peer_args=(--peer-python "$peer" --peer-device "$device")
else
    peer_args=()
fi
[[ $quick == 1 ]] && sizes=(--batches 1 --new-tokens 64) || sizes=()
if XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" bench/decode_throughput.py --rounds 2 "${peer_args[@]}" "${sizes[@]}" \
        --out "$work/decode.json"; then
    check decode --figures "$work/decode.json"
else
    check record --check "decode step" --rc 1 --figure "crashed: see the log above"
fi
if [[ $quick != 1 ]]; then  # a 1B-parameter bf16 model (Llama-3.2-1B's shape), engine and static only
    if XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" bench/decode_throughput.py --shape 1b --dtype bfloat16 \
            --rounds 2 --batches 1,16,64 --new-tokens 256 --out "$work/decode_1b.json"; then
        check decode --figures "$work/decode_1b.json"
    else
        check record --check "decode 1b step" --rc 1 --figure "crashed: see the log above"
    fi
fi

echo "== mfu"
[[ $quick == 1 ]] && sizes=(--shapes gpt2-124m --rounds 1 --steps 3) || sizes=(--rounds 2)
if "$py" bench/mfu.py --peer-python "$peer" "${sizes[@]}" --json "$work/mfu.json"; then
    figure=$("$py" -c "import json, sys
rows = json.load(open(sys.argv[1]))['shapes']
mfu = lambda r: r['lm']['mfu_vendor'] or r['lm']['mfu_measured']
ratio = lambda r: '%.2fx peer' % r['ratio'] if r['ratio'] else 'no peer'
print('; '.join('%s %.1f%%, %s%s' % (r['shape']['name'], 100 * mfu(r), ratio(r), ' (target ' + r['target'].split(': ')[-1] + ')' if 'target' in r else '') for r in rows))" "$work/mfu.json")
    check record --check "train step MFU (mfu.py)" --rc 0 --figure "$figure" \
        --target "MFU >= 50% at 1B and 8B, >= 1.0x peer (H100/H200)"
else
    check record --check "mfu step" --rc 1 --figure "crashed: see the log above"
fi

echo "== moe"
[[ $quick == 1 ]] && sizes=(--rounds 1 --steps 2) || sizes=(--d-model 1024 --layers 8 --seq 2048 --batch 8)
if XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" bench/moe_step.py --dtype bfloat16 "${sizes[@]}" --out "$work/moe.json"; then
    check moe --figures "$work/moe.json"
else
    check record --check "moe step" --rc 1 --figure "crashed: see the log above"
fi

echo
check table

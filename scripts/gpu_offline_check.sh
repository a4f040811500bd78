#!/usr/bin/env bash
# GPU check on one CUDA machine with no network (its own python3 with torch and
# transformers; the kit from scripts/gpu_kit.sh in .gpu/): the engine's exactness tests on
# CUDA in fp32, our decoder against transformers on CUDA with the pair's real architectures,
# step costs and the decode benchmark in bf16 (random weights: costs and plain speed are the
# pair's, acceptance is not). Run from the repository root; OUT (default /tmp/gpu-out) gets
# the JSON. Three parts, each under 10 minutes: `gpu_offline_check.sh exactness`, `... steps`
# and `... decode` (no argument: all three).
set -uo pipefail
export PYTHONUNBUFFERED=1
KIT=${KIT:-.gpu}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/rand
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$KIT"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PART=${1:-all}
if [ "$PART" = all ] || [ "$PART" = exactness ]; then
echo "== exactness suite on CUDA, fp32"
SPECDEC_TEST_DEVICE=cuda timeout 170 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_engine_exactness.py tests/engine/test_engine_behaviour.py 2>&1 | tail -15
echo "== the pair's architectures, random weights"
timeout 170 python3 scripts/gpu_random_pair.py "$KIT" /tmp/rand
echo "== exactness through the captured static step (CUDA graphs), fp32"
SPECDEC_TEST_DEVICE=cuda SPECDEC_TEST_STEP=captured timeout 150 python3 -m pytest -q \
    -p no:cacheprovider tests/engine/test_static_exactness.py 2>&1 | tail -8
fi
[ "$PART" = exactness ] && exit 0
[ -d /tmp/rand/qwen15 ] || timeout 170 python3 scripts/gpu_random_pair.py "$KIT" /tmp/rand
if [ "$PART" = all ] || [ "$PART" = steps ]; then
echo "== waits for the device per captured verify step and draft round (1 each is the aim)"
timeout 90 python3 scripts/gpu_sync_check.py /tmp/rand/qwen15 /tmp/rand/qwen05
echo "== draft round: eager vs the loop captured, bf16, rows 1 8 x k 2 4"
timeout 120 python3 -m benchmarks.draft_round --config serve_config.gpu.yaml --device cuda \
    --dtype bfloat16 --draft /tmp/rand/qwen05 --rows 1 8 --k 2 4 --modes static captured \
    --rounds 3 --steps 5 2>&1 | grep -v "Loading weights"
echo "== step ms: eager vs static vs captured, bf16, rows 1 8 32 x query 1 and k+1 = 4"
timeout 170 python3 -m benchmarks.static_step --device cuda --dtype bfloat16 \
    --target /tmp/rand/qwen15 --draft /tmp/rand/qwen05 --rows 1 8 32 --query 1 4 \
    --modes eager static captured --rounds 3 --steps 10 2>&1 | grep -v "Loading weights"
fi
[ "$PART" = steps ] && exit 0
echo "== bench decode, bf16, batch 1 and 8, eager then captured (c and v at batch 1)"
for step in eager captured; do for b in 1 8; do
    timeout 100 python3 -m cli.main bench decode --device cuda --dtype bfloat16 --step $step \
        --target /tmp/rand/qwen15 --draft /tmp/rand/qwen05 --draft-vocab-limit 32768 \
        --k 2 4 --max-tokens 64 --sets code --prompts-per-set 2 --batch $b \
        $([ $b = 8 ] && echo --no-hf) $([ $b = 1 ] && echo --costs) \
        --json "$OUT/decode_${step}_b$b.json" 2>&1 | grep -v "Loading weights"
done; done

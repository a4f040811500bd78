#!/usr/bin/env bash
# GPU check on one CUDA machine with no network (its own python3 with torch and
# transformers; the kit from scripts/gpu_kit.sh in .gpu/), sized to run in about 8 minutes:
#   exactness  greedy speculative == plain on CUDA in fp32 (the engine's exactness suite, its
#              chi-square cases left to CPU), through the eager and the captured step; our
#              decoder against transformers on CUDA with the pair's real architectures
#   steps      ms per forward, eager against captured (bf16): decode at 1, 4, 8 rows and
#              verifies of k = 2..6; the draft's round; device waits per captured step
#   decode     tokens/s at one row, plain, the draft at k = 2..6 and auto, eager and captured,
#              on the planted pair (the real architectures, acceptance set to the real
#              pair's); greedy identity in bf16 on the random pair
# Run from the repository root; OUT (default /tmp/gpu-out) gets the log. No argument: all.
set -uo pipefail
export PYTHONUNBUFFERED=1
KIT=${KIT:-.gpu}
OUT=${OUT:-/tmp/gpu-out}
RAND=${RAND:-/tmp/rand}
mkdir -p "$OUT" "$RAND"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$KIT"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PART=${1:-all}
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
stamp() { echo "== [$(date +%T), ${SECONDS}s] $*"; }
if part exactness; then
stamp "greedy exactness suite on CUDA, fp32, eager"
SPECDEC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -x \
    tests/engine/test_engine_exactness.py -k "not sampled_first_three and not truncated_q \
    and not contingency" 2>&1 | tail -6
stamp "the same through the captured static step (CUDA graphs), fp32"
SPECDEC_TEST_DEVICE=cuda SPECDEC_TEST_STEP=captured timeout 120 python3 -m pytest -q \
    -p no:cacheprovider tests/engine/test_static_exactness.py 2>&1 | tail -6
fi
if part exactness || [ ! -d "$RAND/qwen15p" ]; then
stamp "the pair's architectures: random and planted checkpoints, logits against transformers"
SPECDEC_COSTS=0 timeout 150 python3 scripts/gpu_random_pair.py "$KIT" "$RAND" 2>&1 \
    | grep -v -e "Loading weights" -e "Writing model"
fi
if part steps; then
stamp "device waits per captured verify step and draft round (1 each is the aim)"
timeout 90 python3 scripts/gpu_sync_check.py "$RAND/qwen15" "$RAND/qwen05"
stamp "step ms, bf16: eager vs captured, rows 1 4 8 x query 1 (decode) and 3..7 (k = 2..6)"
timeout 150 python3 -m specdec_bench.static_step --device cuda --dtype bfloat16 --no-mixed \
    --target "$RAND/qwen15" --draft "$RAND/qwen05" --rows 1 4 8 --query 1 3 4 5 6 7 \
    --modes eager captured --rounds 3 --steps 8 2>&1 | grep -v "Loading weights"
stamp "the draft's round, bf16: eager vs the loop captured, rows 1 8 x k 2..6"
timeout 100 python3 -m specdec_bench.draft_round --config serve_config.gpu.yaml --device cuda \
    --dtype bfloat16 --draft "$RAND/qwen05" --rows 1 8 --k 2 3 4 5 6 --modes captured \
    --rounds 3 --steps 4 2>&1 | grep -v "Loading weights"
fi
if part decode; then
stamp "tokens/s at one row on the planted pair, bf16, eager and captured"
timeout 220 python3 scripts/gpu_decode.py "$RAND/qwen15p" "$RAND/qwen05p" \
    --steps eager captured 2>&1 | grep -v "Loading weights"
stamp "greedy identity in bf16 on the random pair (small margins: rounding shows)"
timeout 100 python3 scripts/gpu_decode.py "$RAND/qwen15" "$RAND/qwen05" --steps eager \
    captured --k 4 --no-auto --max-tokens 64 2>&1 | grep -v "Loading weights"
fi
stamp done

#!/usr/bin/env bash
# GPU check on one CUDA machine: NCCL target group at TP=1, logits equality on CUDA, and
# the decode benchmark on CUDA in bf16. Prints every figure; run from the repository root.
#   bash scripts/gpu_check.sh            (needs network to a package registry for set-up)
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e '.[test]'
nvidia-smi --query-gpu=name,memory.total --format=csv
specdec models fetch qwen-pair
python - <<'PY'
import time, torch
from specdec.pack.hub import resolve
from specdec.model.step.decoder import Decoder
from specdec.model.step.batch import BatchInput
from transformers import AutoModelForCausalLM
path = resolve("qwen2.5-coder-0.5b")
ids = list(range(100, 140))
ours = Decoder.from_checkpoint(path, torch.float32, "cuda")
got = ours(BatchInput.build([(0, 0, ids)], "cuda"), ours.new_cache(1, 64), torch.arange(40, device="cuda"))
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
with torch.no_grad():
    exp = ref(torch.tensor([ids], device="cuda")).logits[0].float()
print(f"cuda fp32 logits max abs diff vs transformers: {(got - exp).abs().max().item():.2e}, "
      f"argmax equal: {torch.equal(got.argmax(-1), exp.argmax(-1))}")
PY
python - <<'PY'
import time
from specdec.engine.spec import ActorResources, ModelGroupSpec, RuntimeSpec
from deployments.launch import local_ray
from deployments.actors.target import RayTargetRunner
with local_ray(num_cpus=4):
    import ray
    r = RayTargetRunner(ModelGroupSpec(model="qwen2.5-coder-1.5b", tp=1, dtype="bfloat16",
                        resources=ActorResources(num_cpus=1, num_gpus=1)),
                        RuntimeSpec(max_slots=4, max_len=1024))
    print("target group:", r.stats)
    r.shutdown()
PY
specdec bench decode --device cuda --no-hf --max-tokens 128 --prompts-per-set 2 --costs

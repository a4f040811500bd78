#!/usr/bin/env bash
# Prepares .gpu/ for scripts/gpu_offline_check.sh on a CUDA machine that reaches no network:
# the pair's configs (read from the GGUF files' metadata) and tokenizer (no weights: that machine builds random ones with the
# same architectures) and the wheels its Python lacks (pydantic). Run on a machine that has
# fetched the pack (`specdec models fetch qwen-pair`) and reaches a package registry.
set -euo pipefail
KIT=${1:-.gpu}
CACHE=${SPECDEC_CACHE:-$HOME/.cache/specdec}/models
mkdir -p "$KIT/whl"
for pair in qwen15:qwen2.5-coder-1.5b qwen05:qwen2.5-coder-0.5b; do
    mkdir -p "$KIT/${pair%%:*}"
    for f in tokenizer.json tokenizer_config.json generation_config.json chat_template.jinja; do
        cp "$CACHE/${pair##*:}/$f" "$KIT/${pair%%:*}/"
    done
    # The pack keeps GGUF files: the architecture's config.json comes from the file's metadata.
    python3 -c "import sys; from transformers import AutoConfig; \
AutoConfig.from_pretrained(sys.argv[1], gguf_file='model.gguf').save_pretrained(sys.argv[2])" \
        "$CACHE/${pair##*:}" "$KIT/${pair%%:*}"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$KIT/whl" pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
du -sh "$KIT"

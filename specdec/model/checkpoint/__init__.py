"""Reading a checkpoint: a Hugging Face folder (config.json, safetensors) or a GGUF file,
its architecture, its decoder shape, and the slice of each weight a tensor-parallel rank
owns. Nothing here runs a forward."""

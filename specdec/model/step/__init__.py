"""Running a step: the decoder, its ragged batch and KV slots, the prefix cache, the
static and CUDA-graph forwards, tensor parallelism, and turning logits into tokens
(sampling, seeded draws, logits processors, grammars)."""

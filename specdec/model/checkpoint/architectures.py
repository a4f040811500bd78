"""The model families the decoder implements, and the error for any other."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class UnsupportedModel(ValueError):
    """A checkpoint of an architecture (or with a tensor type) the decoder cannot run."""

"""The model families the decoder implements (specdec.model.checkpoint.family), and the
error for any other."""

from specdec.model.checkpoint.family import SUPPORTED_ARCHITECTURES  # noqa: F401


class UnsupportedModel(ValueError):
    """A checkpoint of an architecture (or with a tensor type) the decoder cannot run."""

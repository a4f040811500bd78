"""Errors that are the user's to fix (bad model reference, bad option): printed, not traced."""

from specdec.model.checkpoint.architectures import UnsupportedModel
from specdec.pack.hub import ModelNotFound
from specdec.pack.offline import PackError

USER_ERRORS: tuple[type[Exception], ...] = (ModelNotFound, UnsupportedModel, PackError, ValueError)

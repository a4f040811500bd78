"""Errors that are the user's to fix (bad model reference, bad option): printed, not traced."""

from specdec.config import UnsupportedModel
from specdec.hub import ModelNotFound
from specdec.pack import PackError

USER_ERRORS: tuple[type[Exception], ...] = (ModelNotFound, UnsupportedModel, PackError, ValueError)

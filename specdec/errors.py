"""The errors a request or a configuration can meet, whichever layer raises them: the
engine refusing a request, the target lost, a configuration that cannot work. The Serve
layer maps each to its HTTP status."""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    """Why a request was refused or failed; the ingress maps each to one HTTP status."""

    INVALID = "invalid"           # the request's own fault (400), param names the field
    CAPACITY = "capacity"         # slots and queue full (503, retry)
    TARGET_DOWN = "target_down"   # the target is being rebuilt: nothing can start (503)
    TARGET_LOST = "target_lost"   # the target went away mid-request (503, retry)
    INTERNAL = "internal"         # the step failed unexpectedly: a bug to report (500)


class ConfigError(ValueError):
    """A configuration that cannot work; the message starts with the field at fault."""


class EngineError(RuntimeError):
    """A request the engine cannot take (the message names the limit; param, when set, is
    the request field at fault)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(EngineError):
    pass


class TargetDown(CapacityError):
    """The target is being rebuilt after a loss: no request can start until it is back."""


class TargetLost(RuntimeError):
    """The target runner lost its model (a rank died, a call timed out): every request it
    held is gone; the runner rebuilds it in the background (see TargetDown)."""

"""How a model group runs each forward (its config's `step`): the eager ragged forward, the
static step over fixed buffers (specdec/model/step/static_step.py), that step compiled, or
captured as CUDA graphs (specdec/model/step/cuda_graph.py)."""

from __future__ import annotations

from specdec.model.step.cuda_graph import CapturedDecoder
from specdec.model.step.decoder import Decoder
from specdec.model.step.static_step import StaticDecoder
from specdec.vocabulary import StepMode


def with_step(model: Decoder, step: StepMode) -> Decoder | StaticDecoder:
    """The model as its config's `step` runs it (eager: itself)."""
    if step == "eager":
        return model
    if step == "captured":
        return CapturedDecoder(model)
    return StaticDecoder(model, compile=step == "compiled")

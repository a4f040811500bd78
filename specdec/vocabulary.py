"""The project's vocabularies, each spelled once: the values a config, a request or the
command line may name. Nothing here imports torch, so validation and the command line's
choices read them cheaply; the tables that give each word its meaning live with the code
(weight_format.py's formats, step_mode.py's step builders, overlap.py's strategy)."""

from __future__ import annotations

from typing import Literal, get_args

# A weight format (model/formats/weight_format.py: what each stores and runs).
WeightFormatName = Literal["auto", "float32", "bfloat16", "float16", "int8", "w8a8",
                           "int8-dynamic", "q4k", "int4"]
FORMATS: tuple[str, ...] = get_args(WeightFormatName)

# How a model group runs each forward (model/step/step_mode.py).
StepMode = Literal["eager", "static", "compiled", "captured"]

# What a request asks of speculation (spec_decode/speculation.py): auto: the policy
# decides; on: every round drafts; off: plain.
SpecMode = Literal["auto", "on", "off"]
ProposerMethod = Literal["draft", "ngram", "suffix"]  # what a caller may name
Method = Literal[ProposerMethod, "none"]

# The engine's overlap: off: sequential rounds; on: the draft drafts while the target
# verifies; auto: both measured, the faster kept (spec_decode/overlap.py).
OverlapMode = Literal["off", "on", "auto"]

# How the draft picks its guesses: probabilistic (drawn from its top-m q, so sampled rows
# keep more) or greedy (its argmax, q one-hot).
DraftSampling = Literal["probabilistic", "greedy"]

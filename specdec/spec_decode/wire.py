"""What crosses between the engine and a draft that lives in another process.

Each side keeps its own copy of every sequence's context. Per round only the change
crosses: "keep the first `keep` tokens of your copy, then append `new`" (usually one to a
few tokens: what the target kept and its own token). The sampling parameters cross once,
with a sequence's first message. Proposals come back as token ids and, for sampled rows,
the draft's top-m distribution as m (id, prob) pairs per guess, never a vocabulary row.

Messages to and from a shard cross as one `pack`ed blob (pickle protocol 5, what Ray's
serializer would make of them), so the bytes a step costs on the wire are counted for free
from the blob that is sent, instead of pickling it a second time only to measure it.
"""

from __future__ import annotations

import dataclasses
import pickle

from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.proposal import ProposeInput

_TAIL = 64  # contexts change only near their end: compare the tail, check the rest at C speed


@dataclasses.dataclass
class ContextDelta:
    seq_id: str
    keep: int
    new: list[int]
    k: int
    params: SamplingParams | None = None  # only in a sequence's first message
    tenant: str | None = None             # likewise: whose prefixes the draft may reuse


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    start = max(0, n - _TAIL)
    if a[:start] != b[:start]:
        start = 0
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ContextSender:
    """Engine side: turns full contexts into deltas against what the receiver holds."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}

    def encode(self, inputs: list[ProposeInput]) -> list[ContextDelta]:
        out = []
        for i in inputs:
            prev = self._sent.get(i.seq_id)
            ctx = list(i.context)
            if prev is None:
                out.append(ContextDelta(i.seq_id, 0, ctx, i.k, i.params, i.tenant))
            else:
                keep = common_prefix(prev, ctx)
                out.append(ContextDelta(i.seq_id, keep, ctx[keep:], i.k))
            self._sent[i.seq_id] = ctx
        return out

    def forget(self, seq_id: str) -> None:
        self._sent.pop(seq_id, None)

    def sent(self, seq_id: str) -> list[int] | None:
        """The context the receiver holds for a sequence (None: nothing sent yet)."""
        return self._sent.get(seq_id)

    def contexts(self) -> list[list[int]]:
        return list(self._sent.values())

    def reset(self) -> None:
        """The receiver was replaced (a rebuilt draft): the next message sends it all."""
        self._sent.clear()


class ContextReceiver:
    """Draft side: applies deltas to its copies and hands full contexts to the proposer."""

    def __init__(self) -> None:
        self._ctx: dict[str, list[int]] = {}
        self._params: dict[str, SamplingParams] = {}
        self._tenant: dict[str, str | None] = {}
        # Sequences whose context was cut back by the last decode, and to what length: the
        # proposer must drop cache entries past it (appending alone never invalidates).
        self.rewound: dict[str, int] = {}

    def decode(self, deltas: list[ContextDelta]) -> list[ProposeInput]:
        out = []
        self.rewound = {}
        for d in deltas:
            if d.params is not None:
                self._params[d.seq_id] = d.params
                self._tenant[d.seq_id] = d.tenant
                self._ctx[d.seq_id] = []
            ctx = self._ctx.get(d.seq_id)
            if ctx is None:
                raise KeyError(f"draft has no context for sequence {d.seq_id!r}: its first "
                               "message was lost (the draft was restarted?)")
            if d.keep < len(ctx):
                self.rewound[d.seq_id] = d.keep
                del ctx[d.keep:]
            ctx.extend(d.new)
            out.append(ProposeInput(d.seq_id, ctx, d.k, self._params[d.seq_id],
                                    tenant=self._tenant[d.seq_id]))
        return out

    def release(self, seq_id: str) -> None:
        self._ctx.pop(seq_id, None)
        self._params.pop(seq_id, None)
        self._tenant.pop(seq_id, None)


def pack(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def unpack(blob: bytes):
    # Only ever a blob that our own shard or engine packed (as Ray itself unpickles calls).
    return pickle.loads(blob)  # noqa: S301


def payload_bytes(obj) -> int:
    """What `obj` would cost on the wire (for tests and benchmarks; the path counts blobs)."""
    return len(pack(obj))

"""What crosses between the engine and a draft in another process: only the change of each
context, and proposals as ids plus a top-m q, never a vocabulary row."""

from __future__ import annotations

import torch

from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.proposal import Proposal, ProposeInput
from specdec.spec_decode.wire import ContextReceiver, ContextSender, payload_bytes

P = SamplingParams(temperature=0.7, seed=1)


def test_deltas_rebuild_the_contexts_and_carry_only_what_changed():
    send, recv = ContextSender(), ContextReceiver()
    ctx = list(range(1000, 3000))  # a 2000-token prompt crosses once
    first = send.encode([ProposeInput("a", ctx, 4, P)])
    assert first[0].keep == 0 and first[0].params == P
    assert recv.decode(first)[0].context == ctx
    ctx = ctx + [7, 8, 9]          # the round kept two guesses and added its own token
    second = send.encode([ProposeInput("a", ctx, 4, P)])
    assert (second[0].keep, second[0].new, second[0].params) == (2000, [7, 8, 9], None)
    assert payload_bytes(second) < 300 < payload_bytes(first) // 10
    assert recv.decode(second)[0].context == ctx and recv.rewound == {}
    # A rewritten tail (a speculative context the engine took back) is cut, then extended.
    ctx = ctx[:2001] + [5]
    third = send.encode([ProposeInput("a", ctx, 4, P)])
    assert (third[0].keep, third[0].new) == (2001, [5])
    assert recv.decode(third)[0].context == ctx and recv.rewound == {"a": 2001}


def test_a_replaced_receiver_gets_everything_again():
    send, recv = ContextSender(), ContextReceiver()
    recv.decode(send.encode([ProposeInput("a", [1, 2, 3], 2, P)]))
    send.reset()
    fresh = ContextReceiver()
    again = send.encode([ProposeInput("a", [1, 2, 3, 4], 2, P)])
    assert again[0].keep == 0 and fresh.decode(again)[0].context == [1, 2, 3, 4]


def test_the_tenant_crosses_once_and_stays_with_the_sequence():
    """The draft's own prefix cache reuses only the sequence's tenant's slots: it must know
    the tenant on every later round, sent with the first message only."""
    send, recv = ContextSender(), ContextReceiver()
    first = send.encode([ProposeInput("a", [1, 2, 3], 2, P, tenant="key:alice")])
    assert recv.decode(first)[0].tenant == "key:alice"
    later = send.encode([ProposeInput("a", [1, 2, 3, 4], 2, P, tenant="key:alice")])
    assert later[0].tenant is None and recv.decode(later)[0].tenant == "key:alice"


def test_top_m_proposal_is_small_on_the_wire():
    vocab, k, m = 151_936, 4, 64
    full = torch.rand(k, vocab)
    sparse = Proposal([1, 2, 3, 4], torch.zeros(k, m, dtype=torch.int32), torch.rand(k, m))
    assert payload_bytes(sparse) < 4 * k * m * 2 + 2000 < payload_bytes(full) // 100

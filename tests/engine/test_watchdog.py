"""The engine loop's watchdog: a stall with work is reported, idleness is not."""

from specdec.engine.watchdog import Watchdog


def test_stall_only_counts_while_there_is_work():
    now = [0.0]
    w = Watchdog(30.0, clock=lambda: now[0])
    now[0] = 100.0
    assert w.stalled(has_work=False) is None       # idle for 100 s: fine
    assert w.stalled(has_work=True) == 100.0       # 100 s without a step while work waits
    w.beat()
    now[0] = 120.0
    assert w.stalled(has_work=True) is None        # 20 s since the last step: within limit

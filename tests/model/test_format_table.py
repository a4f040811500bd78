"""The weight-format table: each format's facts in one entry, and what resolving a name
gives on this machine."""

from __future__ import annotations

import pytest

from specdec.model.formats.weight_format import (
    DRAFT_ONLY,
    TABLE,
    fbgemm_available,
    resolve_format,
)
from specdec.vocabulary import FORMATS


def test_every_named_format_has_one_entry_and_resolves_here():
    assert set(TABLE) == set(FORMATS)
    for name in FORMATS:
        fmt = resolve_format(name, "cpu")
        # Its own entry, or where something it needs does not run here, a fallback that
        # runs (never an unknown format).
        assert fmt.name in FORMATS, (name, fmt)


def test_a_batch_dependent_format_is_for_drafts_only():
    for name, entry in TABLE.items():
        if entry.batch_dependent:
            assert name in DRAFT_ONLY and "batch" in DRAFT_ONLY[name]
    assert set(DRAFT_ONLY) == {n for n, e in TABLE.items() if e.draft_only}


@pytest.mark.skipif(not fbgemm_available(), reason="the int8 family needs FBGEMM (x86)")
def test_formats_a_target_may_run_keep_each_row_independent_of_its_batch():
    for name in ("int8", "w8a8", "q4k"):
        assert name not in DRAFT_ONLY and resolve_format(name, "cpu").per_row, name
    assert not resolve_format("int8-dynamic", "cpu").per_row

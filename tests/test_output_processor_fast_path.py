"""The output processor builds CompletionOutput / RequestOutput positionally on its hot path: a change to
those dataclasses' field order must fail loudly at import, never swap fields silently."""

from __future__ import annotations

import pytest

from vllm_lite.client import output_processor as op


def test_positional_field_order_matches_the_dataclasses():
    op._check_positional_fields()  # the order the module was written against


def test_a_changed_field_order_raises(monkeypatch):
    swapped = ("index", "token_ids", "text") + op._COMPLETION_FIELDS[3:]
    monkeypatch.setattr(op, "_COMPLETION_FIELDS", swapped)
    with pytest.raises(ImportError, match="CompletionOutput"):
        op._check_positional_fields()

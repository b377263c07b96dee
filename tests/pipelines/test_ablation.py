"""The ablation's variants: drelay-lite = joint.drelay with every v2 part off, + each part alone, all
together; parts joint.drelay leaves off are skipped; an unknown part is named."""

import dataclasses

import pytest

from drelay.config import DRelayLiteSettings, DRelaySettings
from pipelines.ablation import ALL, LITE, PARTS, slug, table, variants


def test_each_variant_differs_from_drelay_lite_by_its_part_alone():
    full = DRelaySettings(reader_dim=64, lambda_repair=0.5, repair_weight=2.0, ce_weight_final=0.5)
    out = variants(full)
    assert list(out) == [LITE, *(f"+ {p}" for p in PARTS), ALL]
    lite = out[LITE]
    assert lite.reader_dim == 64 and lite.lambda_repair == 0.5  # joint.drelay's other settings, not lite's defaults
    assert dataclasses.asdict(out[ALL]) == dataclasses.asdict(full)
    off = DRelayLiteSettings()
    for part, keys in PARTS.items():
        row = dataclasses.asdict(out[f"+ {part}"])
        changed = {k for k, v in row.items() if v != dataclasses.asdict(lite)[k]}
        assert changed == set(keys) - {k for k in keys if getattr(off, k) == getattr(full, k)}, part
    assert all(isinstance(s, DRelayLiteSettings) for s in out.values())


def test_parts_left_off_are_skipped_and_unknown_parts_named():
    out = variants(DRelaySettings(token_rank=0, repair_weight=1.0), only=["token tables", "repair weight", "lattice"])
    assert list(out) == [LITE, "+ lattice", ALL]
    with pytest.raises(ValueError, match="unknown ablation part.*latice.*parts: token tables"):
        variants(DRelaySettings(), only=["latice"])
    assert slug("+ lattice + messages") == "lattice_messages" and slug("drelay (all)") == "drelay_all"


def test_the_table_has_a_row_per_variant_and_acceptance_per_position():
    rows = {LITE: {"replay_tau": 1.5, "gain": 0.0, "native_tau": 1.4, "oracle_tau": 2.0, "replay_accept_pos1": 0.4},
            ALL: {"replay_tau": 1.6, "gain": 0.1, "native_tau": 1.4, "oracle_tau": 2.0, "replay_accept_pos1": 0.5}}
    text = table(rows)
    assert "| drelay (all) | 1.600 | +0.100 |" in text and "| drelay-lite | 0.400 |" in text

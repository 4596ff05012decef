"""deploy/transfer.py: whether the bundle's parts fit a lent machine's calls beside the tree that travels with
each (the real tree of this checkout, real parts of a small incompressible bundle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.record import deploy_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    bundle = tmp_path_factory.mktemp("b") / "tlt-bundle"
    bundle.mkdir()
    (bundle / "payload.bin").write_bytes(os.urandom(5_000_000))
    out = bundle.parent / "parts"
    deploy_script("bundle_parts").write_parts(bundle, out, 2_000_000)
    return out


def test_parts_that_fit_beside_the_tree_take_one_call_each_and_fewer_at_the_largest_fitting_split(parts):
    transfer = deploy_script("transfer")
    tree = transfer.tree_bytes(ROOT)
    assert tree > 1_000_000  # the tracked draft alone is more
    extra = sum((parts / f).stat().st_size for f in transfer.CARRIED_BESIDE)
    result = transfer.fit(parts, ROOT, limit=tree + extra + 3_500_000)
    assert result["fits"] and result["error"] is None
    assert result["calls"] == 3 and result["room_bytes"] == 3_500_000
    assert result["calls_at_fitting_split"] == 2  # ~5.0 MB in parts of 3M


def test_parts_too_big_beside_the_tree_are_refused_with_the_split_that_fits(parts):
    transfer = deploy_script("transfer")
    tree = transfer.tree_bytes(ROOT)
    result = transfer.fit(parts, ROOT, limit=tree + 1_500_000)
    assert not result["fits"] and "SPLIT=1M" in result["error"] and "over a call's" in result["error"]
    alone = transfer.fit(parts, ROOT, limit=tree + 500_000)
    assert not alone["fits"] and "the tree alone" in alone["error"] and alone["calls_at_fitting_split"] is None
    assert transfer.main([str(parts), "--limit", str(tree + 1_500_000), "--root", str(ROOT)]) == 1
    assert transfer.main([str(parts.parent), "--root", str(ROOT)]) == 2  # no parts.json there

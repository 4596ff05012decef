"""deploy/bundle.py's cache under parallel builds (`make test` runs the bundle's modules in two processes): a
node site that another build put in place while this one installed is used, not a crash. The pip install is faked
(the unit under test is what happens around it); the real installs run in test_bundle.py and test_bundle_node.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.record import deploy_script

ROOT = Path(__file__).resolve().parents[2]
SPECS = ["torch==2.13.0"]


@pytest.fixture
def bundle(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "deploy"))  # the script imports its siblings by name, as unpack.py does
    return deploy_script("bundle")


def test_a_node_site_another_build_finished_first_is_used(bundle, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    site = bundle.node_site_path(SPECS, [], cache)

    def pip_install(cmd, *args, **kwargs):  # meanwhile, the other build renames its copy into place
        (Path(cmd[cmd.index("--target") + 1]) / "torch").mkdir()
        site.mkdir()
        (site / "theirs").write_text("")
        return ""

    monkeypatch.setattr(bundle, "run", pip_install)
    assert bundle.node_site(SPECS, [], cache) == site
    assert sorted(p.name for p in site.iterdir()) == ["theirs"]
    assert [p.name for p in cache.iterdir()] == [site.name]  # this build's copy is gone


def test_a_failed_rename_with_no_site_in_place_still_fails(bundle, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    site = bundle.node_site_path(SPECS, [], cache)

    def pip_install(cmd, *args, **kwargs):  # a file where the site goes: the rename fails, and no site is there
        (Path(cmd[cmd.index("--target") + 1]) / "torch").mkdir()
        site.write_text("not a directory")
        return ""

    monkeypatch.setattr(bundle, "run", pip_install)
    with pytest.raises(OSError, match="torch-site-"):
        bundle.node_site(SPECS, [], cache)
    assert [p.name for p in cache.iterdir()] == [site.name]  # nothing half-built left behind

"""kernel.resources: the sample bundles ship in the package and the default path finds them."""

from __future__ import annotations

import pytest

from kernel.bundle import load_bundle_file
from kernel.resources import SAMPLES, resolve_policy_path, sample_policy


@pytest.mark.parametrize("name", SAMPLES)
def test_each_shipped_sample_is_a_valid_bundle(name):
    assert load_bundle_file(str(sample_policy(name))).bundle_version >= 1


def test_an_unknown_sample_is_refused():
    with pytest.raises(ValueError, match="northstar.json"):
        sample_policy("nope.json")


def test_the_relative_default_falls_back_to_the_shipped_sample(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no policies/ folder here
    assert resolve_policy_path("policies/northstar.json") == str(sample_policy("northstar.json"))


def test_an_existing_absolute_or_other_path_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "northstar.json").write_text("{}")
    assert resolve_policy_path("policies/northstar.json") == "policies/northstar.json"  # the operator's file
    assert resolve_policy_path("/etc/leasehold/x.json") == "/etc/leasehold/x.json"
    assert resolve_policy_path("other/northstar.json") == "other/northstar.json"
    assert resolve_policy_path("policies/custom.json") == "policies/custom.json"

"""``leasehold policy compile|seal|fmt|decompile|bump|diff|explain`` as a user runs them: edit a
number, run one command, get a valid, sealed (and signed) bundle the services' own loader accepts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kernel.bundle import encode_bundle, load_bundle_file
from kernel.signing import TrustedKeys, generate_keypair, load_public_key
from leasehold.commands.cli import main

ROOT = Path(__file__).resolve().parents[4]
SRC = ROOT / "policies" / "northstar.yaml"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    p = tmp_path / "ns.yaml"
    shutil.copy(SRC, p)
    return p


def test_edit_a_number_compile_once_get_a_sealed_signed_bundle(src: Path, tmp_path: Path, capsys):
    key, pub = generate_keypair(tmp_path / "keys")
    src.write_text(src.read_text().replace("burst: 20\n", "burst: 25\n", 1))
    assert main(["policy", "compile", str(src), "--key", str(key)]) == 0
    bundle = load_bundle_file(str(src.with_suffix(".json")))  # the services' loader: checksum verified
    TrustedKeys([load_public_key(pub)]).check(bundle)  # and the signature
    assert next(r for r in bundle.rules if r.id == "read-user-v3").capacity_millis == 25_000
    assert "signed by key" in capsys.readouterr().out


def test_compile_refuses_with_file_line_and_rule_and_no_traceback(src: Path, capsys):
    src.write_text(src.read_text().replace("failMode: closed", "failMode: strict", 1))
    assert main(["policy", "compile", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"{src}:" in err and "rule 'export-tenant': failMode 'strict' is not one of local_bounded, closed, open" in err
    assert "Traceback" not in err and not src.with_suffix(".json").exists()


def test_seal_re_seals_an_edited_json_and_validates_it(tmp_path: Path, capsys):
    p = tmp_path / "b.json"
    p.write_text((ROOT / "policies" / "northstar.json").read_text().replace('"capacityMillis": 20000',
                                                                             '"capacityMillis": 30000', 1))
    with pytest.raises(Exception, match="checksum mismatch"):
        load_bundle_file(str(p))
    assert main(["policy", "seal", str(p)]) == 0
    assert load_bundle_file(str(p)).rules[0].capacity_millis == 30_000
    p.write_text(p.read_text().replace('"costMillis": 1000', '"costMillis": 99000', 1))
    assert main(["policy", "seal", str(p)]) == 2
    assert "exceeds capacityMillis" in capsys.readouterr().err


def test_seal_of_a_policy_source_says_compile_it(src: Path, capsys):
    """`policy seal ns.yaml` said "not a bundle: JSON is malformed: invalid character (byte 0)", the
    same text again as a detail."""
    before = src.read_bytes()
    assert main(["policy", "seal", str(src)]) == 2
    err = capsys.readouterr().err
    assert err == (f"leasehold: invalid: {str(src)!r} is a policy source (YAML), not a sealed bundle (JSON): "
                   f"compile it first with `leasehold policy compile {src}`\n")
    assert src.read_bytes() == before
    bad = src.with_suffix(".json")
    bad.write_text("# not JSON\n")
    assert main(["policy", "seal", str(bad)]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1  # the problem once, not again as a detail


def test_bump_a_source_keeps_its_comments_and_a_bundle_is_re_sealed(src: Path, tmp_path: Path):
    before = src.read_text()
    assert main(["policy", "bump", str(src), "--published-at", "2030-01-02T03:04:05Z"]) == 0
    after = src.read_text()
    assert "version: 43\n" in after and "publishedAt: '2030-01-02T03:04:05Z'" in after
    assert [x for x in before.splitlines() if x.lstrip().startswith("#")] == \
        [x for x in after.splitlines() if x.lstrip().startswith("#")]
    j = tmp_path / "b.json"
    shutil.copy(ROOT / "policies" / "northstar.json", j)
    assert main(["policy", "bump", str(j)]) == 0
    assert load_bundle_file(str(j)).bundle_version == 43
    assert main(["policy", "bump", str(j), "--version", "40"]) == 2


def test_fmt_check_and_write(src: Path):
    assert main(["policy", "fmt", "--check", str(src)]) == 0
    assert main(["policy", "fmt", "--check", str(ROOT / "policies" / "northstar-global.yaml")]) == 0
    messy = src.read_text().replace("    rate: 2/s\n    burst: 20\n", "    burst: 20\n    rate: '2/1s'\n", 1)
    src.write_text(messy)
    assert main(["policy", "fmt", "--check", str(src)]) == 1
    assert main(["policy", "fmt", "--write", str(src)]) == 0
    assert src.read_text() == SRC.read_text()  # comments above the rules and the header kept


def test_decompile_then_compile_is_the_same_bundle(tmp_path: Path):
    out = tmp_path / "g.yaml"
    assert main(["policy", "decompile", str(ROOT / "policies" / "northstar-global.json"), "--out", str(out)]) == 0
    assert main(["policy", "compile", str(out)]) == 0
    assert out.with_suffix(".json").read_bytes() == (ROOT / "policies" / "northstar-global.json").read_bytes()


def test_diff_reports_per_field_and_bypasses(src: Path, tmp_path: Path, capsys):
    new = tmp_path / "new.yaml"
    new.write_text(src.read_text().replace("rate: 2/s", "rate: 1/s", 1).replace("cost: 10", "cost: 5", 1)
                   .replace("burst: 300", "burst: 200", 1))
    assert main(["policy", "diff", str(src), str(new), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {i["id"]: i for i in doc["items"]}
    assert by["read-user-v3"]["change"] == "tightened"
    assert by["read-user-v3"]["fields"] == [{"field": "rate", "old": "2/s", "new": "1/s", "verdict": "tightened"}]
    assert by["export-tenant"]["change"] == "loosened"
    assert by["tenant-birch-minute"]["fields"][0]["verdict"] == "tightened"
    # a new bypass is a review: exit 7 (as policy validate --against)
    assert main(["policy", "diff", str(ROOT / "policies" / "northstar.json"),
                 str(ROOT / "policies" / "northstar-global.yaml")]) == 7
    assert "added: bypass 'ops-probe-bypass'" in capsys.readouterr().out


def test_explain_shows_rules_keys_slots_and_trace(tmp_path: Path, capsys):
    pepper = tmp_path / "pepper"
    pepper.write_text("s3cret-pepper")
    assert main(["policy", "explain", str(ROOT / "policies" / "northstar.json"), "--tenant", "atlas",
                 "--principal", "U-17", "--route", "export", "--pepper-file", str(pepper), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in doc["rules"]] == ["export-tenant", "tenant-atlas-minute"]
    slots = doc["call"]["slots"]
    assert [s["role"] for s in slots] == ["cc", "rate", "rate"] and {s["hashTag"] for s in slots} == {"t:atlas"}
    assert doc["call"]["sameSlot"] and doc["call"]["decisionTtlMs"] == 30_000 and not doc["devPepper"]
    from redis.crc import key_slot
    assert slots[0]["slot"] == key_slot(b"{t:atlas}")
    assert main(["policy", "explain", str(ROOT / "policies" / "northstar.json"), "--tenant", "atlas",
                 "--principal", "U-17", "--route", "read"]) == 0
    text = capsys.readouterr().out
    assert "read-user-v3" in text and "store unreachable, read-user-v3: the local fallback" in text
    assert main(["policy", "explain", str(ROOT / "policies" / "northstar.json"), "--tenant", "Not Valid",
                 "--principal", "U-17", "--route", "read"]) == 2


def test_unchanged_sample_bundle_bytes():
    """the JSON the services load is what encode_bundle writes for the compiled source"""
    b = load_bundle_file(str(ROOT / "policies" / "northstar.json"))
    assert (ROOT / "policies" / "northstar.json").read_bytes() == encode_bundle(b) + b"\n"


def test_a_failed_write_is_exit_2_and_leaves_the_old_bundle_whole(src: Path, tmp_path: Path, capsys, monkeypatch):
    import errno
    import os

    target = tmp_path / "ns.json"
    target.write_bytes(b"the old bundle\n")
    for where in (tmp_path / "no-such-dir" / "b.json", tmp_path):  # a missing directory, a directory in the way
        assert main(["policy", "compile", str(src), "--out", str(where)]) == 2
        assert "cannot write" in capsys.readouterr().err

    def full(fd: int) -> None:  # the disk fills up after part of the bundle was written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    for argv in (["compile", str(src), "--out", str(target)], ["seal", str(target)], ["bump", str(src)],
                 ["fmt", "--write", str(src)], ["decompile", str(ROOT / "policies" / "northstar.json"),
                                                "--out", str(target)]):
        before = {p: p.read_bytes() for p in (target, src)}
        code = main(["policy", *argv])
        err = capsys.readouterr().err
        assert code == 2 or argv[0] == "seal", (argv, err)  # seal: the old text is no bundle (exit 2 on reading)
        assert {p: p.read_bytes() for p in (target, src)} == before, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ns.json", "ns.yaml"]  # no temporary file left


def test_fmt_of_a_file_that_is_not_utf8_is_exit_2_naming_the_line(src: Path, capsys):
    src.write_bytes(src.read_bytes() + b"# caf\xe9\n")
    for argv in (["fmt", str(src)], ["fmt", "--check", str(src)], ["fmt", "--write", str(src)], ["bump", str(src)]):
        assert main(["policy", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "not UTF-8 (byte 0xe9)" in err and "unexpected" not in err


def test_explain_a_request_no_rule_applies_to_is_admitted_not_denied(capsys):
    assert main(["policy", "explain", str(SRC), "--tenant", "zed", "--principal", "u", "--route", "nothing"]) == 0
    text = capsys.readouterr().out
    assert "no rule applies" in text and "admitted: no rule can deny this request" in text
    assert "denied" not in text


def test_bump_refuses_a_published_at_that_is_not_a_time(src: Path, tmp_path: Path, capsys):
    bundle = tmp_path / "b.json"
    shutil.copy(ROOT / "policies" / "northstar.json", bundle)
    for f in (src, bundle):
        before = f.read_bytes()
        assert main(["policy", "bump", str(f), "--published-at", "tomorrow"]) == 2
        assert "is not a time" in capsys.readouterr().err and f.read_bytes() == before


def test_compile_warns_when_the_bundle_is_over_etcds_request_limit(src: Path, tmp_path: Path, capsys, monkeypatch):
    from leasehold.commands import policy_cli

    assert main(["policy", "compile", str(src), "--out", str(tmp_path / "a.json")]) == 0
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(policy_cli, "ETCD_REQUEST_BYTES", 1000)
    assert main(["policy", "compile", str(src), "--out", str(tmp_path / "a.json")]) == 0
    assert "bytes: etcd refuses a request over its --max-request-bytes" in capsys.readouterr().err


def test_a_bundle_edited_by_hand_is_refused_saying_how_to_re_seal_it(tmp_path: Path, capsys):
    edited = tmp_path / "b.json"
    edited.write_text((ROOT / "policies" / "northstar.json").read_text().replace('"capacityMillis": 20000',
                                                                                  '"capacityMillis": 90000', 1))
    for argv in (["validate", str(edited)], ["diff", str(ROOT / "policies" / "northstar.json"), str(edited)]):
        assert main(["policy", *argv]) == 2
        err = capsys.readouterr().err
        assert "checksum mismatch" in err and "`leasehold policy seal FILE` re-seals it" in err, argv


def test_diff_of_a_rule_moved_to_another_route_group_is_changed_not_tightened(src: Path, tmp_path: Path, capsys):
    """An operator renames the read route group and lowers its rate: the read requests lose the rule,
    which is no tightening. Was "rule read-user-v3: tightened" (the routeGroup line alone said changed)."""
    new = tmp_path / "new.yaml"
    new.write_text(src.read_text().replace("routeGroup: read", "routeGroup: browse", 1).replace("rate: 2/s", "rate: 1/s", 1))
    assert main(["policy", "diff", str(src), str(new), "-o", "json"]) == 0
    item = {i["id"]: i for i in json.loads(capsys.readouterr().out)["items"]}["read-user-v3"]
    assert item["change"] == "changed" and "selects other requests or keys" in item["summary"]
    assert [(f["field"], f["verdict"]) for f in item["fields"]] == [("routeGroup", "changed"), ("rate", "tightened")]
    assert main(["policy", "diff", str(src), str(new)]) == 0
    assert "rule read-user-v3: changed (routeGroup changed: " in capsys.readouterr().out

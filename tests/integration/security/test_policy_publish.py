"""``leasehold policy`` against a real etcd where an operator (or whoever can write the policy keys)
meets what is published: the version the fleet holds when ``policy/current`` is gone or invalid,
``show``'s exit status for a value the services refuse, the signature checked first by every
command that reads a value from etcd, and two publishes made over the same bundle
(docs/decisions/0080)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest

from kernel.bundle import Bundle, encode_bundle, seal
from kernel.etcd_store import EtcdStore, TxnBuilder
from kernel.policy_store import canary_key, policy_key
from kernel.signing import generate_keypair, load_private_key, sign_bundle
from leasehold.commands.cli import main as cli_main
from tests.support.policies import northstar

ROOT = Path(__file__).resolve().parents[3]


def bump(b: Bundle, version: int, **changes) -> Bundle:
    return seal(msgspec.structs.replace(b, bundle_version=version, **changes))


def edited(b: Bundle, version: int, rule_id: str, capacity_millis: int) -> Bundle:
    rules = [msgspec.structs.replace(r, capacity_millis=capacity_millis) if r.id == rule_id else r for r in b.rules]
    return bump(b, version, rules=rules)


@pytest.fixture
def prefix() -> str:
    return f"/lh-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def common(etcd_cluster, prefix) -> list[str]:
    return ["--etcd", ",".join(etcd_cluster.endpoints), "--prefix", prefix]


async def _write(etcd_cluster, key: bytes, value: bytes | None) -> None:
    """What someone with write access to etcd and no Leasehold tool does (etcdctl put / del)."""
    store = EtcdStore(",".join(etcd_cluster.endpoints))
    try:
        txn = TxnBuilder()
        if value is None:
            txn.delete(key)
        else:
            txn.put(key, value)
        await store.commit(txn)
    finally:
        await store.close()


def write(etcd_cluster, key: bytes, value: bytes | None) -> None:
    import asyncio
    asyncio.run(_write(etcd_cluster, key, value))


def file_of(tmp_path: Path, bundle: Bundle, name: str | None = None) -> Path:
    path = tmp_path / (name or f"v{bundle.bundle_version}.json")
    path.write_bytes(encode_bundle(bundle))
    return path


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it: its own process, its exit status, stdout and stderr."""
    script = Path(sys.executable).with_name("leasehold")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leasehold.commands.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    return subprocess.run([*cmd, *argv], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)


# -- the version the fleet holds outlives the policy key --------------------------------------------
@pytest.mark.parametrize("gone", ["deleted", "invalid"])
def test_a_publish_over_a_deleted_or_invalid_key_is_above_what_the_fleet_took(etcd_cluster, prefix, common,
                                                                               tmp_path: Path, capsys, gone):
    """Bundle 10 is published (every agent takes it); someone deletes ``policy/current`` or writes a value
    that is not a bundle. A publish of bundle 5 then wrote 5 with exit 0 ("the first", "over an invalid
    value"), and every agent refused it as older (``stale``) and kept 10, silently: the operator believed
    5 was in force. It is refused (exit 3) naming 10, the last bundle published; 11 is published."""
    base = northstar()
    assert cli_main(["policy", "publish", str(file_of(tmp_path, bump(base, 10))), *common]) == 0
    write(etcd_cluster, policy_key(prefix), None if gone == "deleted" else b'{"bundleVersion": 99, "rules": 3}')
    capsys.readouterr()
    assert cli_main(["policy", "publish", str(file_of(tmp_path, bump(base, 5))), *common]) == 3
    said = capsys.readouterr().err
    why = "nothing is published there" if gone == "deleted" else "the published value is not a valid bundle"
    assert said.startswith(f"leasehold: not published (stale-version): bundle 5 is not newer than bundle 10, the last "
                           f"one published at {prefix}policy/current ({why}): agents hold it and refuse a lower "
                           "version\n"), said
    assert cli_main(["policy", "publish", str(file_of(tmp_path, bump(base, 11))), *common]) == 0
    said = capsys.readouterr().out
    assert said.startswith("published bundle 11 (over " + ("an empty key" if gone == "deleted" else "an invalid value: ")
                           ), said
    assert "; bundle 10 was the last published) at " in said, said


# -- show: an invalid published value is not a success ----------------------------------------------
def test_show_of_a_value_the_services_refuse_exits_2(etcd_cluster, prefix, common, tmp_path: Path):
    """``policy show`` printed ``INVALID: ...`` (``"valid": false``) and exited 0: a script checking the
    exit status believed the fleet ran what was published. It exits 2 (an invalid bundle), in text and
    JSON, the document still printed; a valid value exits 0."""
    base = northstar()
    assert cli("policy", "publish", str(file_of(tmp_path, bump(base, 10))), *common).returncode == 0
    assert cli("policy", "show", *common).returncode == 0
    write(etcd_cluster, policy_key(prefix), b'{"bundleVersion": 11}')
    res = cli("policy", "show", *common)
    assert res.returncode == 2, res
    assert f"{prefix}policy/current (revision " in res.stdout and ": INVALID: " in res.stdout, res.stdout
    assert res.stderr.startswith(f"leasehold: the value published at {prefix}policy/current is not a bundle the "
                                 "services take: they keep the bundle they hold (exit 2)\n"), res.stderr
    assert "Traceback" not in res.stderr
    res = cli("policy", "show", *common, "-o", "json")
    doc = msgspec.json.decode(res.stdout)  # the document, with the error a failing command's JSON carries
    assert res.returncode == 2 and doc["valid"] is False and doc["error"]["exit"] == 2, res


# -- two publishes over the same bundle ---------------------------------------------------------------
def test_two_publishes_over_the_same_bundle_never_both_succeed(etcd_cluster, prefix, common, tmp_path: Path, capsys):
    """Operators A and B both edit bundle 5. A publishes 6; B publishes its edit under version 9 (``--as-version``
    or a bump past the next version). B's publish was written (9 > 6) and A's edit was gone, silently. A
    publish whose version is not the next one names the bundle it was made over (``--over``); one made
    over another than the published one is refused (exit 3) and writes nothing."""
    base = northstar()
    assert cli_main(["policy", "publish", str(file_of(tmp_path, bump(base, 5))), *common]) == 0
    a = file_of(tmp_path, edited(base, 6, "read-user-v3", 5000), "a.json")
    b = file_of(tmp_path, edited(base, 6, "tenant-birch-minute", 3000), "b.json")
    assert cli_main(["policy", "publish", str(a), *common]) == 0
    capsys.readouterr()
    assert cli_main(["policy", "publish", str(b), "--as-version", "9", *common]) == 3
    said = capsys.readouterr().err
    assert said.startswith("leasehold: not published (version-skip): bundle 9 skips versions above the published 6: "
                           "a bundle is published over the one below it unless --over names the bundle it was made "
                           "over\n"), said
    assert cli_main(["policy", "publish", str(b), "--as-version", "9", "--over", "5", *common]) == 3
    said = capsys.readouterr().err
    assert said.startswith("leasehold: not published (conflict): bundle 6 is published, not bundle 5 this one was "
                           "made over: publishing it would take back bundle 6's changes\n"), said
    assert cli_main(["policy", "show", *common, "-o", "json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["bundleVersion"] == 6  # A's edit, in force
    assert cli_main(["policy", "publish", str(b), "--as-version", "9", "--over", "6", *common, "-o", "json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["published"] == 9


def test_two_concurrent_publishes_from_the_same_base_one_is_refused(etcd_cluster, prefix, common, tmp_path: Path):
    """The two operators' CLIs run at the same moment, both over bundle 5 (A's 6, B's 9 ``--over 5``):
    exactly one is published, the other exits 3 with one line and no traceback."""
    base = northstar()
    assert cli("policy", "publish", str(file_of(tmp_path, bump(base, 5))), *common).returncode == 0
    for round_ in range(3):
        top = 5 + 10 * round_
        a = file_of(tmp_path, edited(base, top + 1, "read-user-v3", 5000 + round_), "a.json")
        b = file_of(tmp_path, edited(base, top + 4, "tenant-birch-minute", 3000 + round_), "b.json")
        script = Path(sys.executable).with_name("leasehold")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leasehold.commands.cli"]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}, "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([*cmd, "policy", "publish", str(f), *extra, *common], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for f, extra in ((a, []), (b, ["--over", str(top)]))]
        done = [(p.wait(60), *p.communicate()) for p in procs]
        assert sorted(code for code, _, _ in done) == [0, 3], done
        assert all("Traceback" not in err for _, _, err in done), done
        won = 0 if done[0][0] == 0 else 1
        # the loser's refusal names what it lost against; catch up for the next round
        res = cli("policy", "show", *common, "-o", "json")
        held = msgspec.json.decode(res.stdout)["bundleVersion"]
        assert held == (top + 1 if won == 0 else top + 4)
        nxt = file_of(tmp_path, bump(base, top + 10), "next.json")
        assert cli("policy", "publish", str(nxt), "--over", str(held), *common).returncode == 0


# -- the signature before the validation, for every command that reads etcd --------------------------
@pytest.fixture
def signed(etcd_cluster, prefix, common, tmp_path: Path):
    """A signed fleet: the signing marker names the key, bundle 10 is published signed by it."""
    key, pub = generate_keypair(tmp_path / "keys", "fleet")
    assert cli_main(["policy", "require-signed", "--public-keys", str(pub), *common]) == 0
    v10 = file_of(tmp_path, bump(northstar(), 10))
    assert cli_main(["policy", "publish", str(v10), "--key", str(key), *common]) == 0
    return key


def unsigned_and_invalid(version: int) -> bytes:
    """What someone who can write etcd but holds no trusted key writes: unsigned, and its checksum wrong."""
    doc = msgspec.json.decode(encode_bundle(bump(northstar(), version)))
    doc["checksum"] = "sha256:" + "0" * 64
    return msgspec.json.encode(doc)


def test_promote_checks_the_candidates_signature_before_it_validates_it(etcd_cluster, prefix, common, signed,
                                                                       tmp_path: Path, capsys):
    """A candidate written into the canary key by hand, unsigned and invalid: ``promote`` validated it first
    and said "not a valid bundle (checksum mismatch ...)", the work a service trusting the fleet's key never
    does (decision 0079). It is refused for its signature alone (exit 2), nothing written."""
    body = b'{"base":10,"slice":{"regions":["eu"]},"bundle":%s}' % unsigned_and_invalid(11)
    write(etcd_cluster, canary_key(prefix), body)
    capsys.readouterr()
    assert cli_main(["policy", "promote", *common]) == 2
    said = capsys.readouterr().err
    assert said.startswith("leasehold: invalid: the staged canary is refused (unsigned): bundle 11 is unsigned"), said
    assert "checksum" not in said, said
    assert cli_main(["policy", "show", *common, "-o", "json"]) == 2  # the canary is refused: not a success either
    shown = msgspec.json.decode(capsys.readouterr().out)
    assert shown["bundleVersion"] == 10 and shown["canary"]["refused"] == "unsigned"


def test_status_and_validate_against_etcd_check_the_signature_first(etcd_cluster, prefix, common, signed,
                                                                    tmp_path: Path, capsys):
    """``status`` and ``validate --against-etcd`` read the published value (and the canary) and validated
    them whatever signed them; with the signing marker they verify first, as ``show`` and the services do."""
    write(etcd_cluster, canary_key(prefix),
          b'{"base":10,"slice":{"regions":["eu"]},"bundle":%s}' % unsigned_and_invalid(11))
    capsys.readouterr()
    assert cli_main(["policy", "status", "--agent-urls", "http://127.0.0.1:9", *common]) == 5
    said = capsys.readouterr()
    write(etcd_cluster, policy_key(prefix), unsigned_and_invalid(12))
    assert cli_main(["policy", "status", "--agent-urls", "http://127.0.0.1:9", *common]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"leasehold: nothing valid is published at {prefix}policy/current: refused (unsigned): "
                           "bundle 12 is unsigned"), said
    assert "checksum" not in said, said
    nxt = file_of(tmp_path, sign_bundle(bump(northstar(), 13), load_private_key(str(signed))))
    assert cli_main(["policy", "validate", str(nxt), "--against-etcd", *common]) == 0
    said = capsys.readouterr().err
    assert said.startswith(f"leasehold: the bundle published at {prefix}policy/current is refused (unsigned): bundle "
                           "12 is unsigned"), said
    assert "checksum" not in said, said


async def test_a_promote_over_an_invalid_value_is_above_the_last_bundle_published(etcd_cluster, prefix):
    """Bundle 12 staged over 10, 13 published, then a value that is not a bundle written over it: ``promote``
    had no published bundle to compare with and wrote 12, which every agent (holding 13) refused as older.
    It is refused (``stale-version``) naming 13; a rollback goes above 13."""
    from kernel.errors import StaleVersion
    from kernel.policy_store import PolicyStore, Slice

    base = northstar()
    store = PolicyStore(EtcdStore(",".join(etcd_cluster.endpoints)), prefix)
    try:
        await store.publish(encode_bundle(bump(base, 10)))
        await store.stage(encode_bundle(bump(base, 12)), Slice(regions=["eu"]))
        await store.publish(encode_bundle(bump(base, 13)))
        await store.store.put(store.key, b'{"bundleVersion": 14}')
        with pytest.raises(StaleVersion, match="bundle 13 was the last one published"):
            await store.promote()
        with pytest.raises(StaleVersion, match="above 13"):
            await store.rollback(encode_bundle(bump(base, 13)))
        assert (await store.rollback(encode_bundle(bump(base, 14)))).version == 14
    finally:
        await store.store.close()


def test_a_canary_no_trusted_key_signed_bounds_nothing_a_new_one_must_be_above(etcd_cluster, prefix, common, signed,
                                                                               tmp_path: Path, capsys):
    """A candidate written into the canary key by hand, unsigned, as bundle 50: every agent of the slice
    refuses it, so none holds it. ``canary`` validated it before any signature check and refused a signed
    candidate 11 ("bundle 50 is staged: a new candidate needs a higher version"), for a bundle no agent
    runs; it verifies it first with the marker's keys, and stages 11 over it."""
    write(etcd_cluster, canary_key(prefix),
          b'{"base":10,"slice":{"regions":["eu"]},"bundle":%s}' % encode_bundle(bump(northstar(), 50)))
    v11 = file_of(tmp_path, bump(northstar(), 11))
    capsys.readouterr()
    assert cli_main(["policy", "canary", str(v11), "--regions", "eu", "--key", str(signed), *common]) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    assert cli_main(["policy", "show", *common, "-o", "json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["canary"]["bundleVersion"] == 11


async def test_a_stage_and_a_promote_stay_above_the_last_bundle_published(etcd_cluster, prefix):
    """Bundle 10 published, then bundle 8 written over it by hand (a valid bundle, below it): a candidate 9
    was staged over 8 and its promote wrote 9 and took the published version back from 10 to 9, so a
    publish of 10 was then accepted again. The stage is refused naming 10, and a promote of a candidate
    that is there anyway (written by hand, or staged before the upgrade) is refused as stale; 11 stages
    and promotes."""
    from kernel.errors import PolicyError, StaleVersion
    from kernel.policy_store import PolicyStore, Slice

    base = northstar()
    store = PolicyStore(EtcdStore(",".join(etcd_cluster.endpoints)), prefix)
    try:
        await store.publish(encode_bundle(bump(base, 10)))
        await store.store.put(store.key, encode_bundle(bump(base, 8)))
        with pytest.raises(PolicyError, match=r"bundle 10 was the last one published .*: the candidate's version 9 "
                                              "must be above it"):
            await store.stage(encode_bundle(bump(base, 9)), Slice(regions=["eu"]))
        assert await store.store.get(store.canary_key) is None
        await store.store.put(store.canary_key, b'{"base":8,"slice":%s,"bundle":%s}' % (
            msgspec.json.encode(Slice(regions=["eu"])), encode_bundle(bump(base, 9))))
        with pytest.raises(StaleVersion, match="bundle 10 was the last one published .bundle 8 was written below it "
                                               "since.: the candidate 9 is not newer"):
            await store.promote()
        assert await store.read_published_version() == 10
        await store.stage(encode_bundle(bump(base, 11)), Slice(regions=["eu"]))
        assert (await store.promote()).version == 11
        assert await store.read_published_version() == 11
    finally:
        await store.store.close()

"""translate_redis_error and the loader, without a network."""

from pathlib import Path

import pytest
from redis import exceptions as rex

from kernel.algorithms import KINDS
from kernel.errors import AmbiguousOutcome, DecisionConflict, NothingRan, ScriptRejected, StoreUnavailable
from region_agent.decision.call import Call, multi_rule_argv, parse_multi_rule, script_for
from region_agent.store.lua_loader import expand_includes, parse_variant
from region_agent.store.scripts import KeysNotColocated, Scripts, StoreRefused, not_run, translate_redis_error


@pytest.mark.parametrize(("exc", "sent", "kind"), [
    (rex.ResponseError("ERR rate limit policy arguments invalid"), True, ScriptRejected),
    (rex.ResponseError("CROSSSLOT Keys in request don't hash to the same slot"), True, KeysNotColocated),
    (rex.RedisClusterException("EVALSHA - all keys must map to the same key slot"), False, KeysNotColocated),
    (rex.ResponseError("BUSY Redis is busy running a script"), True, StoreUnavailable),
    (rex.NoScriptError("NOSCRIPT No matching script"), True, StoreUnavailable),
    (rex.ClusterDownError("The cluster is down"), True, StoreUnavailable),
    (rex.MaxConnectionsError("Too many connections"), True, StoreUnavailable),
    (rex.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), False, StoreUnavailable),
    (rex.ConnectionError("Connection closed by server."), True, AmbiguousOutcome),
    (rex.TimeoutError("Timeout reading from socket"), True, AmbiguousOutcome),
    (rex.TimeoutError("Timeout connecting to server"), False, StoreUnavailable),
    (TimeoutError(), True, AmbiguousOutcome),
])
def test_translation(exc, sent, kind):
    got = translate_redis_error(exc, sent)
    assert type(got) is kind
    assert got.retriable == (kind in (StoreUnavailable, AmbiguousOutcome))
    assert "127.0.0.1" not in got.detail  # driver text is not echoed


def _parsed(reply: str) -> BaseException:
    """An error reply as redis-py hands it over: its parser picks the class by the reply's prefix
    and strips that prefix from the message (so a test that writes ``ResponseError("OOM ...")``
    by hand does not see what the agent sees)."""
    from redis._parsers.base import BaseParser

    return BaseParser.parse_error(reply)


@pytest.mark.parametrize(("reply", "kind", "cause"), [
    ("OOM command not allowed when used memory > 'maxmemory'. script: 89ab, on @user_script:1.", StoreRefused, "oom"),
    ("NOPERM User agent has no permissions to run the 'evalsha' command", StoreRefused, "acl"),
    ("NOPERM No permissions to access a key", StoreRefused, "acl"),
    ("ERR The user executing the script can't run this command or subcommand script: 104a, on @user_script:1.",
     StoreRefused, "acl"),  # a script's redis.call('TIME') the ACL denies (Redis 7.0)
    ("WRONGPASS invalid username-password pair or user is disabled.", StoreRefused, "auth"),
    ("NOAUTH Authentication required.", StoreRefused, "auth"),
    ("CROSSSLOT Keys in request don't hash to the same slot", KeysNotColocated, None),
    ("READONLY You can't write against a read only replica.", StoreUnavailable, None),
    ("LOADING Redis is loading the dataset in memory", StoreUnavailable, None),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", StoreUnavailable, None),
    ("BUSY Redis is busy running a script.", StoreUnavailable, None),
])
def test_translation_of_replies_as_the_driver_parses_them(reply, kind, cause):
    """A refused command is a store condition (counted by the breaker, the decision degraded as
    STORE_UNREACHABLE), never a policy error — whatever redis-py did to the reply's text."""
    got = translate_redis_error(_parsed(reply), True)
    assert type(got) is kind, (reply, got)
    assert got.retriable == (kind is not KeysNotColocated)
    assert getattr(got, "cause", None) == cause


def test_a_refusal_wrapped_by_the_unix_socket_handshake_is_still_a_refusal():
    """redis-py's unix-socket connection raises ``ConnectionError(exc) from exc`` for a refused
    AUTH or SELECT: not an ambiguous lost connection."""
    for reply, cause in (("NOPERM User agent has no permissions to run the 'select' command", "acl"),
                         ("WRONGPASS invalid username-password pair or user is disabled.", "auth")):
        inner = _parsed(reply)
        try:
            raise rex.ConnectionError(inner) from inner
        except rex.ConnectionError as wrapped:
            got = translate_redis_error(wrapped, True)
        assert type(got) is StoreRefused and got.cause == cause


def test_a_certificate_that_does_not_verify_is_a_refusal_not_an_outage():
    import ssl

    # redis-py raises its ConnectionError while handling the ssl error: the ssl error is its context
    e = rex.ConnectionError("Error 1 connecting to 10.0.0.1:6380. certificate verify failed")
    e.__context__ = ssl.SSLCertVerificationError(1, "certificate verify failed")
    got = translate_redis_error(e, False)
    assert type(got) is StoreRefused and got.cause == "tls" and "10.0.0.1" not in got.detail


@pytest.mark.parametrize(("exc", "kind", "cause"), [
    # the SCRIPT LOAD after a NOSCRIPT (or a new connection's HELLO) was sent and its connection lost
    # or timed out: ambiguous for that command, but the call itself was not written, so it did not run
    (rex.ConnectionError("Connection closed by server."), NothingRan, None),
    (ConnectionResetError(104, "Connection reset by peer"), NothingRan, None),
    (rex.TimeoutError("Timeout reading from socket"), NothingRan, "timeout"),
    # the reload could not connect, or the store refused it: what it was (degrade at once)
    (rex.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), StoreUnavailable, None),
    (rex.TimeoutError("Timeout connecting to server"), StoreUnavailable, "timeout"),
    (rex.ResponseError("BUSY Redis is busy running a script"), StoreUnavailable, None),
    (rex.NoPermissionError("User agent has no permissions to run the 'script|load' command"), StoreRefused, "acl"),
])
def test_a_call_stopped_before_it_was_written(exc, kind, cause):
    got = not_run(exc)
    assert type(got) is kind, got
    assert got.extra.get("cause") == cause
    assert not isinstance(got, AmbiguousOutcome) and isinstance(got, StoreUnavailable)
    assert "127.0.0.1" not in got.detail


def test_script_errors_are_not_ambiguous_even_if_sent():
    assert not isinstance(translate_redis_error(rex.ResponseError("ERR x"), True), AmbiguousOutcome)


def test_include_is_expanded_once_and_guarded(tmp_path: Path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.lua").write_text("local A = 1\n")
    (tmp_path / "lib" / "b.lua").write_text("-- @include lib/a.lua\nlocal B = A + 1\n")
    (tmp_path / "s.lua").write_text("-- @include lib/a.lua\n-- @include lib/b.lua\nreturn B\n")
    src = expand_includes(tmp_path / "s.lua", tmp_path)
    assert src.count("local A = 1") == 1 and src.index("local A = 1") < src.index("local B = A + 1")
    (tmp_path / "evil.lua").write_text("-- @include ../etc/passwd\n")
    with pytest.raises(ValueError):
        expand_includes(tmp_path / "evil.lua", tmp_path)


def test_default_scripts_and_shas():
    s = Scripts()
    files = {"token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_counter",
             "multi_rule", "concurrency_acquire", "concurrency_release", "concurrency_renew",
             "pool_deposit", "pool_close", "pool_balance", "pool_take", "pool_refund", "hot_chunk",
             "approx_reconcile"}
    # the scripts that dispatch on call kinds come with a lean variant per kind from the start
    assert set(s.scripts) == files | {f"{n}[{k}]" for n in ("multi_rule", "hot_chunk") for k in KINDS}
    assert all(len(s.sha(n)) == 40 for n in s.scripts)
    for name in s.scripts:
        assert not any(line.strip().startswith("-- @include") for line in s.source(name).splitlines())
    assert s.source("multi_rule").count("local function lh_int") == 1


def test_multi_rule_argv_and_parse():
    keys, argv = multi_rule_argv("d", [Call("k1", "tb", (1, 2, 3, 4, 0)), Call("k2", "cc", (3, 9, 0, 0, 0))],
                                 slack_ms=5, decision_ttl_ms=6, member="m", question="q1")
    assert keys == ["d", "k1", "k2"] and argv == [5, 6, "m", "tb", 1, 2, 3, 4, 0, "cc", 3, 9, 0, 0, 0, "q1"]
    r = parse_multi_rule([0, 1, 500, 0, 639000])
    assert (r.allowed, r.denied_by, r.retry_after_ms, r.remaining) == (False, 1, 500, (0, 639000))
    with pytest.raises(DecisionConflict):  # the record belongs to another question
        parse_multi_rule([-1, 0, 0, 0, 0])
    with pytest.raises(ScriptRejected):
        parse_multi_rule([1, 0])
    with pytest.raises(ScriptRejected):
        multi_rule_argv("d", [Call("k", "leaky", (1, 1, 1, 1, 0))], slack_ms=0, decision_ttl_ms=0, member="m")
    with pytest.raises(ScriptRejected):
        multi_rule_argv("d", [], slack_ms=0, decision_ttl_ms=0, member="m")


def test_unknown_script_name_is_rejected():
    with pytest.raises(ScriptRejected):
        Scripts().sha("leaky_bucket")


def test_lua_dir_from_environment(tmp_path: Path, monkeypatch):
    (tmp_path / "only.lua").write_text("return 1\n")
    monkeypatch.setenv("LEASEHOLD_LUA_DIR", str(tmp_path))
    assert set(Scripts().scripts) == {"only"}


def test_a_lean_variant_carries_only_its_kinds_libraries():
    s = Scripts()
    assert "multi_rule[tb]" in s.scripts and "multi_rule[fw,tb]" not in s.scripts  # one kind: from the start
    name = script_for(("tb", "fw", "tb"))
    assert name == "multi_rule[fw,tb]" and len(s.sha(name)) == 40  # registered when first named
    one, two = s.source("multi_rule[tb]"), s.source(name)
    assert "local ALG = { tb = TB }" in one
    assert one.count("local TB = {}") == 1 and "local SL = {}" not in one
    assert one.count("local function lh_int") == 1  # the shared libraries still come once
    assert "local ALG = { fw = FW, tb = TB }" in two and "local SL = {}" not in two
    # the rest of the script is the full script's, line for line
    body = s.source("multi_rule").split("local MAX_RULES = 8", 1)[1]
    assert one.endswith(body) and two.endswith(body)
    assert len({s.sha(n) for n in ("multi_rule", "multi_rule[tb]", "multi_rule[fw,tb]")}) == 3


@pytest.mark.parametrize("name", ["multi_rule[tb,fw]", "multi_rule[tb,tb]", "multi_rule[xx]", "multi_rule[]",
                                  "multi_rule[tb];x", "../x[tb]", "token_bucket[tb]", "nope[tb]"])
def test_names_that_are_not_variants_are_refused(name):
    """Malformed, unsorted, repeated or unknown kinds are not a variant's name; neither is a
    well-formed name of a script without a ``-- @kinds`` line (or of no script)."""
    assert (parse_variant(name) is None) == (name not in ("token_bucket[tb]", "nope[tb]"))
    s = Scripts()
    with pytest.raises(ScriptRejected):
        s.sha(name)
    assert name not in s.scripts

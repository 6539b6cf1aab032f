"""kernel.config: flags over env over defaults, switches, and errors that name the setting and
list the valid values."""

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

from kernel.config import ConfigError, build_parser, load_settings, settings_flags
from kernel.options import Help


class Demo(msgspec.Struct, forbid_unknown_fields=True):
    """Demo settings."""

    redis_url: Annotated[str, Help("where Redis is", kind="url", schemes=("redis",))] = "redis://127.0.0.1:6379/0"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535), Help("listen port")] = 8080
    fail_mode: Annotated[Literal["closed", "open"], Help("what to do")] = "closed"
    verbose: Annotated[bool, Help("say more")] = False
    urls: list[str] = []
    key_file: Annotated[str | None, Help("a key", kind="file", requires=("cert_file",))] = None
    cert_file: Annotated[str | None, Help("a certificate", kind="file")] = None
    out: Annotated[str | None, Help("where to write", kind="out-file")] = None
    host: Annotated[str, Help("listen address", kind="host")] = "127.0.0.1"


def test_flags_override_env_override_defaults():
    s = load_settings(Demo, "X_", ["--port", "9000"], env={"X_PORT": "7000", "X_VERBOSE": "true", "X_URLS": "a,b"})
    assert s.port == 9000 and s.verbose is True and s.urls == ["a", "b"]
    assert load_settings(Demo, "X_", [], env={}).port == 8080
    assert load_settings(Demo, "X_", [], env={}).verbose is False
    assert load_settings(Demo, "X_", [], env={"X_PORT": "7000"}).port == 7000
    assert load_settings(Demo, "X_", ["--no-verbose"], env={"X_VERBOSE": "TRUE"}).verbose is False
    assert load_settings(Demo, "X_", ["--verbose"], env={"X_VERBOSE": "false"}).verbose is True


def test_invalid_values_name_the_setting_and_the_valid_values():
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", ["--fail-mode", "sideways"], env={})
    assert str(e.value) == "invalid value 'sideways' for --fail-mode: expected one of: closed, open"
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", [], env={"X_PORT": "70000"})
    assert str(e.value) == "invalid value '70000' for X_PORT (--port): expected an integer in [1, 65535]"
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", ["--port", "eighty"], env={})
    assert str(e.value) == "invalid value 'eighty' for --port: expected an integer in [1, 65535]"
    with pytest.raises(ConfigError, match="--redis-url: expected a URL starting with redis://"):
        load_settings(Demo, "X_", ["--redis-url", "http://x"], env={})
    with pytest.raises(ConfigError) as e:  # a URL is echoed without what stands before its '@'
        load_settings(Demo, "X_", ["--redis-url", "http://user:s3cr/t@x:1/0"], env={})
    assert str(e.value) == ("invalid value 'http://…@x:1/0' for --redis-url: expected a URL starting with "
                            "redis://")
    # an IPv6 literal without brackets (what http://$(POD_IP):8080 gives on an IPv6 cluster): no
    # client parses it, so it is refused at start rather than handed to the other services
    with pytest.raises(ConfigError, match=r"an IPv6 address in a URL goes in brackets"):
        load_settings(Demo, "X_", ["--redis-url", "redis://fd00::1:6379/0"], env={})
    assert load_settings(Demo, "X_", ["--redis-url", "redis://[fd00::1]:6379/0"], env={}).redis_url
    assert load_settings(Demo, "X_", ["--redis-url", "redis://u@[fd00::1]:1,h:2,[::1]:3/0"], env={}).redis_url
    with pytest.raises(ConfigError, match=r"an IPv6 address in a URL goes in brackets"):
        load_settings(Demo, "X_", ["--redis-url", "redis://h:1,fd00::2:3/0"], env={})
    with pytest.raises(ConfigError, match="expected an IP address or a host name"):
        load_settings(Demo, "X_", ["--host", "999.1.1.1"], env={})
    assert load_settings(Demo, "X_", ["--host", "::1"], env={}).host == "::1"
    assert load_settings(Demo, "X_", ["--host", "redis-0.redis.svc"], env={}).host == "redis-0.redis.svc"


@pytest.mark.parametrize("word", ["yes", "1", "on", "", "maybe"])
def test_env_switches_are_true_or_false_only(word: str):
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", [], env={"X_VERBOSE": word})
    assert str(e.value) == f"invalid value {word!r} for X_VERBOSE (--verbose): expected true or false"


@pytest.mark.parametrize("argv", [["--verbose", "true"], ["--verbose", "false"], ["--verbose=true"],
                                  ["--no-verbose", "yes"]])
def test_the_old_valued_switch_form_is_refused_with_the_new_spelling(argv: list[str]):
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", argv, env={})
    assert "is a switch and takes no value" in str(e.value) and "--verbose" in str(e.value)
    assert "--no-verbose" in str(e.value)


def test_usage_errors_are_one_line_config_errors():
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", ["--bogus", "1"], env={}, prog="demo")
    assert str(e.value) == "unrecognized arguments: --bogus 1 (see demo --help)"
    with pytest.raises(ConfigError, match="ambiguous|unrecognized"):
        load_settings(Demo, "X_", ["--fail", "open"], env={})  # no abbreviations: a new option cannot shadow


def test_files_and_options_that_need_another(tmp_path: Path):
    key, cert = tmp_path / "k", tmp_path / "c"
    key.write_text("k")
    cert.write_text("c")
    with pytest.raises(ConfigError, match="invalid value '.*nope' for --key-file: no such file"):
        load_settings(Demo, "X_", ["--key-file", str(tmp_path / "nope")], env={})
    with pytest.raises(ConfigError, match="not a regular file"):
        load_settings(Demo, "X_", ["--key-file", str(tmp_path)], env={})
    with pytest.raises(ConfigError, match=r"--key-file needs --cert-file \(or X_CERT_FILE\) as well"):
        load_settings(Demo, "X_", ["--key-file", str(key)], env={})
    s = load_settings(Demo, "X_", ["--key-file", str(key)], env={"X_CERT_FILE": str(cert)})
    assert (s.key_file, s.cert_file) == (str(key), str(cert))
    with pytest.raises(ConfigError, match="its directory .* does not exist"):
        load_settings(Demo, "X_", ["--out", str(tmp_path / "no" / "x.log")], env={})
    assert load_settings(Demo, "X_", [], env={"X_KEY_FILE": ""}).key_file is None  # empty env: unset


def test_missing_required_settings_are_named():
    class Needs(msgspec.Struct):
        etcd: Annotated[str, Help("the etcd cluster")]
        port: int = 1

    with pytest.raises(ConfigError) as e:
        load_settings(Needs, "N_", [], env={})
    assert str(e.value) == "missing required setting --etcd (or N_ETCD): the etcd cluster"
    # given empty (a flag, or an env file's line left blank): missing too, not a failure at start-up
    for argv, env in ((["--etcd", ""], {}), ([], {"N_ETCD": ""})):
        with pytest.raises(ConfigError) as e:
            load_settings(Needs, "N_", argv, env=env)
        assert str(e.value) == "missing required setting --etcd (or N_ETCD): the etcd cluster"


def test_settings_flags_read_back():
    flags = settings_flags(Demo, {"verbose": True, "port": 1, "urls": ["a", "b"], "key_file": None})
    assert flags == ["--verbose", "--port", "1", "--urls", "a,b"]
    assert settings_flags(Demo, {"verbose": False}) == ["--no-verbose"]
    assert load_settings(Demo, "X_", flags, env={}).urls == ["a", "b"]
    with pytest.raises(ValueError, match="no setting 'verbos'"):
        settings_flags(Demo, {"verbos": True})


def test_help_says_meaning_default_and_environment():
    text = build_parser(Demo, "X_", prog="demo").format_help()
    assert "--verbose, --no-verbose" in text
    assert "listen port; 1-65535 (default: 8080)" in " ".join(text.split())
    assert "X_<OPTION>" in text and "switches as true or false" in " ".join(text.split())

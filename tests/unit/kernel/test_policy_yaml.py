"""Reading a policy source as a careless or hostile author writes it (``kernel/policy_yaml.py``):
every bad input is a :class:`SourceFileError` naming the file and the line, never another
exception, and never a value that means something other than what the file says."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kernel.policy_yaml import SourceFileError, compile_file, compile_text, read_text

RULE = """version: 1
publishedAt: '2030-01-01T00:00:00Z'
rules:
  - id: a
    scope: user
    algorithm: token_bucket
    rate: 2/s
    burst: {burst}
    failMode: local_bounded
    fallback: {fallback}
"""


def refused(text: str) -> SourceFileError:
    with pytest.raises(SourceFileError) as e:
        compile_text(text, "p.yaml")
    return e.value


def test_an_alias_bomb_is_refused_at_once_not_expanded():
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    rows += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
    text = "version: 1\npublishedAt: x\n" + "\n".join(rows) + "\nrules: []\n"  # 9^9 strings when expanded
    started = time.monotonic()
    e = refused(text)
    assert time.monotonic() - started < 5
    assert "p.yaml:4: a YAML alias" in e.detail and "not accepted" in e.detail
    assert len(e.errors) <= 11 and e.errors[-1].startswith("... and ")


def test_an_alias_is_refused_where_it_is_used_naming_the_anchor():
    text = RULE.format(burst=2, fallback="&fb {rate: 1/s, burst: 1}") + (
        "  - id: b\n    scope: key\n    algorithm: token_bucket\n    rate: 2/s\n    burst: 2\n"
        "    failMode: local_bounded\n    fallback: *fb\n")
    e = refused(text)
    assert e.detail == ("p.yaml:17: a YAML alias (*) of the value anchored on line 10: aliases are not accepted in "
                        "a policy source, write the value out where it applies")


def test_a_merge_key_is_refused_by_name_not_as_a_missing_field():
    text = ("version: 1\npublishedAt: x\nrules:\n  - <<: {scope: user, failMode: closed}\n    id: a\n"
            "    algorithm: token_bucket\n    rate: 2/s\n    burst: 2\n")
    assert "p.yaml:4: a YAML merge key (<<) is not accepted" in refused(text).detail


@pytest.mark.parametrize("burst", [".inf", "-.inf", ".nan"])
def test_an_infinite_or_nan_amount_is_an_error_of_the_rule(burst: str):
    e = refused(RULE.format(burst=burst, fallback="{rate: 1/s, burst: 1}"))
    assert e.detail.startswith("p.yaml:8: rule 'a': burst")
    e = refused(RULE.format(burst=2, fallback="{rate: 1/s, burst: " + burst + "}"))
    assert e.detail.startswith("p.yaml:10: rule 'a': ")


def test_a_syntax_error_names_the_line_and_the_column_and_a_tab_is_named():
    e = refused("version: 1\nrules:\n  - id: a\n\tscope: user\n")
    assert e.detail.startswith("p.yaml:4:1: not valid YAML: ") and "a tab" in e.detail
    e = refused("version: 1\nrules: [a, b\n")
    assert e.detail.startswith("p.yaml:3:1: not valid YAML: ")


def test_bytes_that_are_not_utf8_name_the_line(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_bytes(RULE.format(burst=2, fallback="{rate: 1/s, burst: 1}").encode() + b"# caf\xe9\n")
    with pytest.raises(SourceFileError) as e:
        read_text(p)
    assert e.value.detail == f"{p}:11: not UTF-8 (byte 0xe9): a policy file is UTF-8 text"
    with pytest.raises(SourceFileError, match="not UTF-8"):
        compile_file(p)
    p.write_bytes(b"\xef\xbb\xbf" + RULE.format(burst=2, fallback="{rate: 1/s, burst: 1}").encode())
    assert compile_file(p).bundle_version == 1  # a BOM is allowed


def test_a_missing_file_or_a_directory_is_named(tmp_path: Path):
    for p in (tmp_path / "none.yaml", tmp_path):
        with pytest.raises(SourceFileError, match="cannot read"):
            read_text(p)


@pytest.mark.parametrize("published", ["x", "'2026-13-45'", "'2026-11-06 09:30'", "'2026-11-06T09:30:00'", "5"])
def test_published_at_is_a_time_with_its_offset(published: str):
    text = f"version: 1\npublishedAt: {published}\nrules: []\n"
    assert refused(text).detail.startswith("p.yaml:2: publishedAt")


def test_published_at_accepts_rfc3339_quoted_or_bare():
    for published in ("'2026-11-06T09:30:00Z'", "2026-11-06T09:30:00Z", "'2026-11-06T10:30:00.250+01:00'"):
        assert compile_text(f"version: 1\npublishedAt: {published}\nrules: []\n", "p.yaml").bundle_version == 1

"""kernel.options: one meaning per settings field, read by --help, the checks and the docs tables."""

from typing import Annotated, Literal

import msgspec
import pytest

from allocator.settings import ENV_PREFIX as ALLOCATOR_ENV
from allocator.settings import AllocatorSettings
from kernel.config import ServingSettings
from kernel.options import Help, markdown_table, option_named, options
from region_agent.service.settings import ENV_PREFIX as AGENT_ENV
from region_agent.service.settings import AgentSettings


class Base(msgspec.Struct, kw_only=True):
    shared: Annotated[int, Help("inherited", section="Shared")] = 1


class Demo(Base, kw_only=True):
    mode: Annotated[Literal["a", "b"], Help("the mode", section="Main")] = "a"
    flag: Annotated[bool, Help("a switch")] = True
    hosts: Annotated[list[str], Help("somewhere | else")] = []
    peer: Annotated[str | None, Help("the peer", default="--mode's peer")] = None
    count: Annotated[int, msgspec.Meta(ge=0, le=9), Help("how many")] = 3


def test_options_carry_flag_env_default_and_own_fields_first():
    names = [o.name for o in options(Demo, "D_")]
    assert names == ["mode", "flag", "hosts", "peer", "count", "shared"]  # inherited last
    o = option_named(Demo, "D_", "count")
    assert (o.flag, o.env, o.default_text(), o.constraint(), o.metavar) == ("--count", "D_COUNT", "3", "0-9", "N")
    assert o.help_line() == "how many; 0-9 (default: 3)"
    assert option_named(Demo, "D_", "flag").default_text() == "true"
    assert option_named(Demo, "D_", "hosts").default_text() == "none"
    assert option_named(Demo, "D_", "peer").help_line() == "the peer (default: --mode's peer)"
    assert option_named(Demo, "D_", "mode").metavar == "{a,b}"
    with pytest.raises(ValueError, match="unknown kind"):
        Help("x", kind="nonsense")


def test_markdown_table_has_a_row_per_option_and_escapes_pipes():
    table = markdown_table(Demo, "D_")
    assert "**Main**" in table and "**Shared**" in table
    assert table.index("**Main**") < table.index("**Shared**")
    assert "| `--flag`, `--no-flag` | `D_FLAG` | `true` | a switch |" in table
    assert "somewhere \\| else" in table
    assert "| `--peer TEXT` | `D_PEER` | --mode's peer | the peer |" in table
    assert table.count("\n| `--") == 6


@pytest.mark.parametrize("cls,prefix", [(AgentSettings, AGENT_ENV), (AllocatorSettings, ALLOCATOR_ENV)])
def test_every_service_option_says_what_it_does(cls, prefix):
    """A field added without Help(...) fails here: --help and the docs would show no meaning."""
    opts = options(cls, prefix)
    missing = [o.flag for o in opts if len(o.help) < 10]
    assert not missing, f"add Help(...) to {missing}"
    for o in opts:
        assert o.help_line().endswith(")"), o.flag
        if o.required:
            assert "(required)" in o.help_line()
        else:
            assert "(default: " in o.help_line()
    assert opts[0].section, "the first option opens a section"
    sections = [o.section for o in opts if o.section]
    repeated = sorted({s for s in sections if sections.count(s) > 1})
    assert not repeated, f"a section is opened once; these open twice in --help and the docs: {repeated}"
    assert [o.name for o in opts][-len(ServingSettings.__struct_fields__):] == list(ServingSettings.__struct_fields__)

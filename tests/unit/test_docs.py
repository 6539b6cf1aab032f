"""The README and docs/ stay usable: every link resolves to a file (and a heading, for an anchor),
no page points at documents a user of the repository does not have, the README stays an entry
point, and every command the README shows is one the tools accept (the README's commands are run
for real by tests/e2e/test_readme_commands.py). What the pages state about the code stays true where
a cheap check can tell: no switch is written with a value, every repository path a page or shipped
config names exists, docs/security.md names every etcd permission the roles script grants, and
docs/dependencies.md gives a reason for every runtime dependency."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from leasehold.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
# what must never appear in prose: documents outside the repository, the design's private codes
FORBIDDEN = {
    "a path outside the repository": re.compile(r"\.\./shared|/work/"),
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.I),
    "the design document": re.compile(r"\bthe seed\b|\bseed's\b|\bch\.\s*\d+|\bchapter\s+\d+", re.I),
    # a chapter code or the design's name inside a file or test name (``test_trace_ch18``)
    "a name taken from the design document": re.compile(r"(?<![A-Za-z0-9])ch\d{1,2}(?![A-Za-z0-9])|seed_ch|seed_numbers",
                                                        re.I),
}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def sh_blocks(page: Path) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", page.read_text(), re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif frag and dest.is_file() and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page: Path):
    prose = CODE.sub("", FENCE.sub("", page.read_text()))  # test and file names may keep old words
    found = [f"{what}: {m.group(0)!r}" for what, rx in FORBIDDEN.items() for m in rx.finditer(prose)]
    assert not found, f"{page.relative_to(ROOT)}: " + "; ".join(found)


SOURCE_SUFFIXES = (".py", ".pyi", ".md", ".lua", ".yml", ".yaml", ".json", ".toml", ".cfg", ".conf", ".sh", ".env")
SOURCE_SKIP = {".venv", ".git", "node_modules", "build", "dist", "chaos-reports", "bench-results", ".pytest_cache",
               ".mypy_cache", ".ruff_cache", "docs"}  # docs/ and the README: the prose checks above
# these two hold the patterns and the strings that prove the patterns bite
PATTERN_FILES = {Path(__file__).resolve(), ROOT / "tests" / "unit" / "test_invariants_doc.py"}


def source_files() -> list[Path]:
    """Every file of the repository a reader opens beside the docs: source, tests, scripts, the
    chaos suite, the tools, the shipped configs and manifests, Makefile."""
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in SOURCE_SKIP or any(part.endswith(".egg-info") for part in rel.parts):
            continue
        if p.is_file() and p not in PAGES and p.resolve() not in PATTERN_FILES and (
                p.suffix in SOURCE_SUFFIXES or p.name in ("Makefile", "Dockerfile")):
            out.append(p)
    return out


def test_no_source_file_points_outside_the_repository():
    """Comments, docstrings and messages give their reason in the repository's own words or link
    to docs/, never to an issue number or the reference design a reader does not have."""
    files = source_files()
    assert len(files) > 200 and ROOT / "region_agent" / "decision" / "engine.py" in files and ROOT / "Makefile" in files
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)!r}" for p in files
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             for rx in FORBIDDEN.values() for m in rx.finditer(line)]
    assert not found, "say it in the repository's own words or link to docs/: " + "; ".join(found)


def test_no_file_is_named_after_a_document_the_reader_does_not_have():
    """File names say what a file holds: no chapter code, no name of the design document."""
    paths = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "tests/unit/test_docs.py" in paths
    found = [p for p in paths for rx in FORBIDDEN.values() if rx.search(p.replace("/", " ").replace(".", " "))]
    assert not found, found


def test_the_checks_can_fail(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#nowhere) [c](#title) see the seed's ch. 15, issue 24, ../shared/x test_trace_ch18\n")
    assert links(page) == ["missing.md", "#nowhere", "#title"]
    assert anchors(page) == {"title"}
    prose = CODE.sub("", FENCE.sub("", page.read_text()))
    assert all(rx.search(prose) for rx in FORBIDDEN.values())
    assert slug("Probes: readiness and store health") == "probes-readiness-and-store-health"
    assert slug("`leasehold` CLI — exit codes") == "leasehold-cli--exit-codes"


def test_the_readme_is_an_entry_point():
    lines = README.read_text().splitlines()
    assert 120 <= len(lines) <= 200, len(lines)
    text = README.read_text()
    for must in ("make run", "make test", "minutes on 2 cores", ".venv/bin/leasehold status", "docs/glossary.md"):
        assert must in text, must


def test_the_readme_make_targets_exist():
    targets = [line.split()[1] for block in sh_blocks(README) for line in block.splitlines()
               if line.startswith("make ")]
    assert {"run", "test"} <= set(targets)
    for t in targets:
        r = subprocess.run(["make", "-n", "-C", str(ROOT), t], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"make {t}: {r.stderr}"


def test_every_leasehold_command_of_the_readme_and_docs_parses():
    """The CLI accepts each `leasehold ...` line as written (``$VAR`` and ``$(...)`` as placeholders, a
    bracketed ``[--option X]`` as optional)."""
    parser = build_parser()
    seen = 0
    for page in PAGES:
        for block in sh_blocks(page):
            for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined
                m = re.match(r"^(?:\S+=\S+ |\w+=(\$\())?(?:\.venv/bin/)?leasehold\s+(.*?)(?(1)\))(?:\s+#.*)?$",
                             line)  # also VAR=$(leasehold ...)
                if not m:
                    continue
                command = re.sub(r"\s*\[[^\]]*\]", "", m.group(2))  # `[--opt X]`: an optional part, shown
                argv = [a if "$" not in a else "X" for a in shlex.split(command)]
                argv = argv[:argv.index("|")] if "|" in argv else argv  # `leasehold ... | jq ...`
                try:
                    parser.parse_args(argv)
                except SystemExit as e:
                    pytest.fail(f"{page.relative_to(ROOT)}: `leasehold {m.group(2)}` is refused ({e.code})")
                seen += 1
    assert seen >= 6


# -- what the pages state about the code: switches, paths, etcd permissions, dependencies ----------
# the pages that describe the repository as it is now (decision records and the changelog keep history)
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
CURRENT = [ROOT / p for p in TRACKED if p.endswith(".md") and not p.startswith(("docs/decisions/", "tests/"))
           and p != "CHANGELOG.md"]
CONFIGS = [ROOT / p for p in TRACKED if p.startswith("deploy/") or p.endswith(".env") or p == "Makefile"]


def switches() -> set[str]:
    """``--x`` and ``--no-x`` of every boolean option of both services: a switch takes no value."""
    from allocator.settings import ENV_PREFIX as ALLOCATOR_ENV
    from allocator.settings import AllocatorSettings
    from kernel.options import options
    from region_agent.service.settings import ENV_PREFIX as AGENT_ENV
    from region_agent.service.settings import AgentSettings

    return {f for cls, prefix in ((AgentSettings, AGENT_ENV), (AllocatorSettings, ALLOCATOR_ENV))
            for o in options(cls, prefix) if o.is_bool for f in (o.flag, o.negative_flag)}


SWITCH_WITH_VALUE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)[ =]+[\"']?(?:true|false)\b")


def switches_given_a_value(text: str, known: set[str]) -> list[str]:
    return [m.group(0) for m in SWITCH_WITH_VALUE.finditer(text) if m.group(1) in known]


def test_no_page_gives_a_switch_a_value():
    """`--auth-disabled true` is refused at start (a switch is `--x` / `--no-x`; `true` / `false`
    only in the environment), so a page that writes it tells the reader a command that fails."""
    known = switches()
    assert {"--auth-disabled", "--no-auth-disabled", "--access-log"} <= known
    assert len(CURRENT) > 25 and ROOT / "region_agent" / "README.md" in CURRENT
    found = [f"{p.relative_to(ROOT)}: {hit}" for p in (*CURRENT, *CONFIGS)
             for hit in switches_given_a_value(p.read_text(errors="replace"), known)]
    assert not found, "write the switch alone (--x or --no-x): " + "; ".join(found)


# a repository path named in a page (in `code`) or in a shipped config: it exists, or it is made at run time
MADE_AT_RUN_TIME = (".run/", ".venv/", "deploy/secrets", "deploy/k8s-dev/secrets", "bench-results", "chaos-reports")
NOT_PATHS = {"leasehold/region", "leasehold/scrape", "leasehold/gateway", "tests/path/to/test_x.py"}  # Kubernetes label keys; a placeholder


def repository_paths(text: str, markdown: bool, tops: set[str]) -> list[str]:
    alternatives = "|".join(sorted(map(re.escape, tops)))
    pattern = re.compile(rf"(?<![\w./-])((?:{alternatives})/[\w./-]*[\w/])")
    spans = re.findall(r"`([^`\n]+)`", text) if markdown else text.splitlines()
    return [m.group(1).rstrip(".") for span in spans for m in pattern.finditer(span)]


def test_every_repository_path_a_page_or_config_names_exists():
    tops = {p.split("/")[0] for p in TRACKED if "/" in p}
    assert {"docs", "deploy", "region_agent", "allocator"} <= tops
    missing = []
    for page in (*CURRENT, *CONFIGS):
        for path in repository_paths(page.read_text(errors="replace"), page.suffix == ".md", tops):
            if path.startswith(MADE_AT_RUN_TIME) or path in NOT_PATHS or "*" in path:
                continue
            if not (ROOT / path).exists() and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "no such file or folder: " + "; ".join(missing)


ROLES_SCRIPT = ROOT / "deploy" / "etcd" / "leasehold-roles.sh"


def etcd_grants(script: str) -> dict[str, set[str]]:
    """role -> the keys (under the prefix) the roles script grants it, `policy/` style."""
    out: dict[str, set[str]] = {}
    for role, key in re.findall(r'^grant (leasehold-\w+) \w+ "\$\{P\}([^"]+)"', script, re.M):
        out.setdefault(role, set()).add(key)
    return out


def test_the_security_page_names_every_etcd_permission_the_roles_script_grants():
    grants = etcd_grants(ROLES_SCRIPT.read_text())
    assert {"leasehold-publisher", "leasehold-allocator", "leasehold-agent"} <= set(grants)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `\w+` / `(leasehold-\w+)` \|(.*)\|$",
                                                          (ROOT / "docs" / "security.md").read_text(), re.M)}
    unnamed = [f"{role}: {key}" for role, keys in grants.items() for key in sorted(keys)
               if f"`{key}`" not in rows.get(role, "")]
    assert not unnamed, "docs/security.md's etcd roles table misses: " + "; ".join(unnamed)


def runtime_dependencies() -> list[str]:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower() for d in deps]


def test_every_runtime_dependency_says_why_it_is_there():
    table = (ROOT / "docs" / "dependencies.md").read_text().split("## Extras")[0].lower()
    deps = runtime_dependencies()
    assert {"litestar", "redis", "pyyaml"} <= set(deps)
    unexplained = [d for d in deps if not re.search(rf"(?<![\w-]){re.escape(d)}(?![\w-])", table)]
    assert not unexplained, "docs/dependencies.md gives no reason for: " + ", ".join(unexplained)


def test_the_code_checks_can_fail():
    assert switches_given_a_value("run it with `--auth-disabled true`, or `--access-log=false`",
                                  {"--auth-disabled", "--access-log"}) == ["--auth-disabled true", "--access-log=false"]
    assert switches_given_a_value("`--workers 2` and LEASEHOLD_AGENT_AUTH_DISABLED=true", {"--auth-disabled"}) == []
    assert repository_paths("see `deploy/etcd-roles.sh` and `docs/api.md#probes`", True, {"deploy", "docs"}) == [
        "deploy/etcd-roles.sh", "docs/api.md"]
    assert repository_paths("# role: deploy/etcd-roles.sh; /run/secrets/deploy/x", False, {"deploy"}) == [
        "deploy/etcd-roles.sh"]
    assert etcd_grants('grant leasehold-agent read "${P}policy/" prefix\n') == {"leasehold-agent": {"policy/"}}


def test_the_readme_names_every_debian_package_and_the_suites_time_as_make_does():
    makefile = (ROOT / "Makefile").read_text()
    packages = {p for name in ("RUN_PACKAGES", "TEST_PACKAGES")
                for p in re.search(rf"^{name} := (.*)$", makefile, re.M).group(1).split() if not p.startswith("$(")}
    prerequisites = README.read_text().split("## Prerequisites")[1].split("\n## ")[0]
    unnamed = sorted(p for p in packages if f"`{p}`" not in prerequisites)
    assert not unnamed, f"README, Prerequisites: make also installs {unnamed}"
    minutes = re.search(r"about \*\*(\d+) minutes on 2 cores\*\*", README.read_text()).group(1)
    assert f"about {minutes} minutes on 2 cores" in makefile, "make help and the README state one time for make test"


def unknown_commands(text: str, parser) -> list[str]:
    """`leasehold WORD [WORD]` in inline code whose command words the CLI does not have."""
    import argparse

    def commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next((dict(a.choices) for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})

    bad = []
    for span in re.findall(r"`(?:\.venv/bin/)?leasehold ([^`\n]*)`", text):
        p, said = parser, []
        for word in span.split():
            subs = commands(p)
            if not subs or word.startswith(("-", "$", "<", "[", ".")) or word.isupper():
                break
            said.append(word)
            if word not in subs:
                bad.append("leasehold " + " ".join(said))
                break
            p = subs[word]
    return bad


def test_every_leasehold_command_a_page_names_exists():
    parser = build_parser()
    found = [f"{p.relative_to(ROOT)}: `{c}`" for p in CURRENT for c in unknown_commands(p.read_text(), parser)]
    assert not found, "no such command: " + "; ".join(found)
    assert unknown_commands("`leasehold validate --bound`, `leasehold policy validate F`, `leasehold up`", parser) == [
        "leasehold validate"]


def unknown_options(text: str, parser) -> list[str]:
    """`--options` a page gives a `leasehold ...` command (in inline code, which may wrap lines, or
    a line of an ``sh`` block; bracketed optional parts included) that neither the command nor
    `leasehold` itself has."""
    import argparse

    def commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next((dict(a.choices) for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})

    def options(p: argparse.ArgumentParser) -> set[str]:
        return {s for a in p._actions for s in a.option_strings}

    spans = re.findall(r"`(?:\.venv/bin/)?leasehold ([^`]*)`", text)
    spans += [m.group(1) for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
              for m in re.finditer(r"(?:^|[\s($])(?:\.venv/bin/)?leasehold\s+([^\n|#)]*)", block.replace("\\\n", " "))]
    bad = []
    for span in spans:
        p = parser
        for word in span.split():
            if word not in commands(p):
                break
            p = commands(p)[word]
        bad += [f"`leasehold {span.strip()}`: {o}" for o in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", span)
                if o not in options(p) | options(parser)]
    return bad


def test_every_option_a_page_gives_a_leasehold_command_exists():
    """docs/capacity.md showed `leasehold capacity ... [--json]`, an option no command has (`-o json`)."""
    parser = build_parser()
    found = [f"{p.relative_to(ROOT)}: {c}" for p in CURRENT for c in unknown_options(p.read_text(), parser)]
    assert not found, "no such option: " + "; ".join(found)
    assert unknown_options("`leasehold capacity --calls-per-s N\n[--rules R] [--json]`, `leasehold -o json status`",
                           parser) == ["`leasehold capacity --calls-per-s N\n[--rules R] [--json]`: --json"]
    assert unknown_options("```sh\nX=$(leasehold admit --tenant a --bogus)\n```\n", parser) == [
        "`leasehold admit --tenant a --bogus`: --bogus"]

"""``leasehold policy`` commands for writing and staging policies (docs/policy.md):

* ``compile SRC``  — a policy source (YAML) into the sealed bundle (signed with ``--key``);
* ``seal FILE``    — re-seal an edited bundle JSON (checksum recomputed; signed with ``--key``);
* ``fmt FILE``     — a source (or bundle) in its canonical form (``--check``: exit 1 if it is not);
* ``decompile FILE`` — a bundle as a policy source;
* ``bump FILE``    — the next version, ``publishedAt`` now (a source keeps its comments);
* ``diff OLD NEW`` — rules and pools added, removed, tightened, loosened, per field, and bypasses;
* ``explain``      — the rules, keys, slots and trace of one request;
* ``replay NEW --log FILES [--against CURRENT]`` — the sampled decision log through a bundle;
* ``canary`` / ``promote`` / ``rollback`` / ``status`` — a staged release through etcd.

Every command's output goes through :func:`emit` and :func:`fail` (``leasehold.commands.output``'s
convention: text, or one JSON document with ``-o json``) and its exit code is one of
``leasehold.commands.output.Exit``. Registered by :func:`register` from ``leasehold.commands.cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from kernel.bundle import NESTED_TOO_DEEPLY, Bundle, refuse_repeated_keys, seal, validate_bundle
from kernel.errors import PolicyError
from kernel.policy_yaml import bundle_bytes, compile_file, is_source, load_policy, read_text, source_text

from .argtypes import whole
from .output import Exit, Failure, add_output_option, out, write_file

EXIT_OK, EXIT_USAGE, EXIT_DIFFERS, EXIT_BYPASS, EXIT_CANARY_WORSE = (
    Exit.OK, Exit.USAGE, Exit.DIFFERS, Exit.BYPASS, Exit.WORSE)
SIGNING_KEY_ENV = "LEASEHOLD_POLICY_SIGNING_KEY"


# ------------------------------------------------------------------------------ output
def emit(args: argparse.Namespace, doc: Any, lines: list[str] | None = None, *, err: bool = False) -> None:
    """The one place these commands print (the CLI's convention, ``leasehold.commands.output``): ``doc``
    as JSON with ``-o json``, else ``lines`` (or ``doc`` as JSON when there are none); ``err``:
    diagnostic lines for stderr."""
    if err:
        out(args).note("\n".join(lines) if lines is not None else json.dumps(doc, indent=2))
        return
    out(args).result(doc, "\n".join(lines) if lines is not None else None)


def fail(args: argparse.Namespace, e: PolicyError | str, code: int = EXIT_USAGE) -> int:
    """Report a failure as every command does (stderr line, ``{"error": ...}`` with ``-o json``)
    and return its exit code."""
    if isinstance(e, str):
        return out(args).failure(Failure(Exit(code), e))
    return out(args).failure(Failure(Exit(code), f"invalid: {e.detail}",
                                     e.further + policy_hints(e)))


def policy_hints(e: PolicyError) -> list[str]:
    """What to do about a refused bundle, where the message alone does not say it."""
    if any("checksum mismatch" in p for p in (e.detail, *e.errors)):
        return ["the content was changed after it was sealed: if the edit is meant, `leasehold policy seal FILE` "
                "re-seals it (and `--key` signs it); never edit the checksum by hand"]
    return []


def _signing_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "key", None) or os.environ.get(SIGNING_KEY_ENV) or None


def _finish(args: argparse.Namespace, bundle: Bundle) -> Bundle:
    """Sign ``bundle`` when a key is configured (``--key`` or LEASEHOLD_POLICY_SIGNING_KEY)."""
    key = _signing_key(args)
    if not key:
        return bundle
    from kernel.signing import load_private_key, sign_bundle
    return sign_bundle(bundle, load_private_key(key))


ETCD_REQUEST_BYTES = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)


def _written(args: argparse.Namespace, verb: str, bundle: Bundle, out: Path) -> None:
    size = len(bundle_bytes(bundle))
    if size > ETCD_REQUEST_BYTES:
        emit(args, None, [f"leasehold: warning: {out} is {size:,} bytes: etcd refuses a request over its "
                          "--max-request-bytes (1.5 MiB by default), so `policy publish` of it fails unless that "
                          "limit is raised"], err=True)
    signed = f", signed by key {bundle.key_id}" if bundle.key_id else ", unsigned"
    emit(args, {"wrote": str(out), "bundleVersion": bundle.bundle_version, "checksum": bundle.checksum,
                "keyId": bundle.key_id, "rules": len(bundle.rules), "pools": len(bundle.pools)},
         [f"{verb} bundle {bundle.bundle_version} ({len(bundle.rules)} rules, {len(bundle.pools)} pools, "
          f"{bundle.checksum}{signed}) -> {out}"])


# ------------------------------------------------------------------------------ compile, seal, fmt
def cmd_compile(args: argparse.Namespace) -> int:
    if not is_source(args.source):
        return fail(args, f"{args.source}: a policy source ends in .yaml or .yml (to re-seal a bundle JSON use "
                          "`leasehold policy seal`)")
    try:
        bundle = _finish(args, compile_file(args.source))
    except PolicyError as e:
        return fail(args, e)
    out = Path(args.out) if args.out else Path(args.source).with_suffix(".json")
    write_file(out, bundle_bytes(bundle))
    _written(args, "compiled", bundle, out)
    return EXIT_OK


def _decode_unsealed(raw: bytes) -> Bundle:
    """A bundle JSON whose checksum (and signature) may be stale: checked for everything else."""
    from kernel.bundle import _unflatten
    try:
        doc = msgspec.json.decode(raw)
        problems = _unflatten(doc)
        if isinstance(doc, dict):
            doc["checksum"] = ""
            doc.pop("keyId", None)
            doc.pop("signature", None)
        bundle = seal(msgspec.convert(doc, type=Bundle))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise PolicyError(f"not a bundle: {e}", errors=[str(e)]) from None
    except RecursionError:
        raise PolicyError(NESTED_TOO_DEEPLY) from None
    refuse_repeated_keys(raw)
    validate_bundle(bundle, problems)
    return bundle


def cmd_seal(args: argparse.Namespace) -> int:
    from kernel.bundle import read_bundle_bytes

    try:
        raw = read_bundle_bytes(args.file)  # a policy source is named: compile seals it
        bundle = _finish(args, _decode_unsealed(raw))
    except PolicyError as e:
        return fail(args, e)
    out = Path(args.out or args.file)
    write_file(out, bundle_bytes(bundle))
    _written(args, "sealed", bundle, out)
    return EXIT_OK


def cmd_fmt(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        text = read_text(path)
        bundle = load_policy(path)
    except PolicyError as e:
        return fail(args, e)
    if is_source(path):
        from kernel.policy_yaml import comments
        canonical = source_text(bundle, *comments(text))
    else:
        canonical = bundle_bytes(bundle).decode()
    if args.check:
        ok = canonical == text
        emit(args, {"file": str(path), "canonical": ok},
             [f"{path}: {'canonical' if ok else 'not canonical (run leasehold policy fmt --write)'}"])
        return EXIT_OK if ok else EXIT_DIFFERS
    if args.write:
        write_file(path, canonical.encode())
        emit(args, {"wrote": str(path)}, [f"formatted {path}" + (" (the header and the comments above each rule "
                                                                   "and pool are kept, others are not)"
                                                                   if is_source(path) else "")])
    elif out(args).json:
        emit(args, {"file": str(path), "text": canonical})
    else:
        sys.stdout.write(canonical)
    return EXIT_OK


def cmd_decompile(args: argparse.Namespace) -> int:
    try:
        bundle = load_policy(args.file)
    except PolicyError as e:
        return fail(args, e)
    text = source_text(bundle, "# yaml-language-server: $schema=https://leasehold.dev/schema/policy-source.schema.json\n"
                               f"# decompiled from {Path(args.file).name} (bundle {bundle.bundle_version})\n")
    if args.out:
        write_file(args.out, text.encode())
        emit(args, {"wrote": args.out}, [f"wrote {args.out}"])
    elif out(args).json:
        emit(args, {"file": args.file, "text": text})
    else:
        sys.stdout.write(text)
    return EXIT_OK


# ------------------------------------------------------------------------------ bump
_TOP = r"^({key}:[ \t]*)([^\n#]*?)([ \t]*(#.*)?)$"


def _bump_source(text: str, version: int, published: str) -> str:
    for key, value in (("version", str(version)), ("publishedAt", f"'{published}'")):
        pattern = re.compile(_TOP.format(key=key), re.M)
        if pattern.search(text) is None:
            raise PolicyError(f"no top-level {key}: line to bump")
        text = pattern.sub(lambda m, v=value: f"{m.group(1)}{v}{m.group(3)}", text, count=1)
    return text


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_bump(args: argparse.Namespace) -> int:
    from kernel.policy_source import SourceError, check_timestamp

    path = Path(args.file)
    published = args.published_at or now_text()
    try:
        check_timestamp(published, "--published-at")
    except SourceError as e:
        return fail(args, str(e))
    try:
        current = load_policy(path)
        version = args.version or current.bundle_version + 1
        if version <= current.bundle_version:
            return fail(args, f"--version {version} is not higher than the file's {current.bundle_version}")
        if is_source(path):
            text = _bump_source(read_text(path), version, published)
            from kernel.policy_yaml import compile_text
            bundle = compile_text(text, str(path))
            write_file(path, text.encode())
            emit(args, {"wrote": str(path), "bundleVersion": version, "publishedAt": published},
                 [f"{path}: version {current.bundle_version} -> {version}, publishedAt {published} "
                  f"(compile it with `leasehold policy compile {path}`)"])
            return EXIT_OK
        bundle = _finish(args, seal(msgspec.structs.replace(current, bundle_version=version, published_at=published)))
    except (OSError, UnicodeDecodeError) as e:
        return fail(args, f"cannot read {path}: {e}")
    except PolicyError as e:
        return fail(args, e)
    write_file(path, bundle_bytes(bundle))
    _written(args, "bumped", bundle, path)
    return EXIT_OK


# ------------------------------------------------------------------------------ diff, explain
def cmd_diff(args: argparse.Namespace) -> int:
    from kernel.bypass import needs_review
    from kernel.policy_diff import diff, render

    try:
        old, new = load_policy(args.old), load_policy(args.new)
    except PolicyError as e:
        return fail(args, e)
    d = diff(old, new)
    doc = {"from": d.old_version, "to": d.new_version,
           "items": [{"kind": i.kind, "id": i.id, "change": i.change, "summary": i.summary or None,
                      "fields": [{"field": f.field, "old": f.old, "new": f.new, "verdict": f.verdict}
                                 for f in i.fields]} for i in d.items],
           "bypasses": [{"kind": c.kind, "rule": c.rule, "tenant": c.tenant, "owner": c.owner, "details": c.details}
                        for c in d.bypasses]}
    emit(args, doc, render(d))
    if needs_review(d.bypasses):
        print("REVIEW: the new bundle adds or widens a privileged bypass (exit 7)", file=sys.stderr)
        return EXIT_BYPASS
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from kernel.errors import LeaseholdError

    from .policy_explain import explain, read_pepper, render
    try:
        bundle = load_policy(args.file)
        pepper = read_pepper(args.pepper_file)
        ptype = "anonymous" if args.ip and not args.principal else args.principal_type
        doc = explain(bundle, tenant=args.tenant, principal=args.principal or args.ip or "", principal_type=ptype,
                      route=args.route, api_key=args.api_key, ip=args.ip, cost=args.cost, pepper=pepper)
    except PolicyError as e:
        return fail(args, e)
    except LeaseholdError as e:
        return fail(args, f"this request cannot be asked: {e.detail}")
    except (OSError, ValueError) as e:
        return fail(args, str(e))
    emit(args, doc, render(doc, bundle))
    return EXIT_OK


# ------------------------------------------------------------------------------ registration
def _out_opt(sp: argparse.ArgumentParser) -> None:
    add_output_option(sp)  # -o text|json, also given before the command name


def _key_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--key", help=f"sign with this Ed25519 private key (PEM; default ${SIGNING_KEY_ENV} when set)")


def register(psub: Any, etcd_opts: Any) -> None:
    """Add these commands to ``leasehold policy`` (``psub``: its subparsers; ``etcd_opts`` adds the
    etcd connection flags)."""
    sp = psub.add_parser("compile", help="compile a policy source (YAML) into the sealed bundle JSON")
    sp.add_argument("source")
    sp.add_argument("--out", help="default: the source's name with .json")
    _key_opt(sp)
    _out_opt(sp)
    sp.set_defaults(func=cmd_compile)
    sp = psub.add_parser("seal", help="re-seal an edited bundle JSON (checksum recomputed, validated)")
    sp.add_argument("file")
    sp.add_argument("--out", help="default: rewrite FILE")
    _key_opt(sp)
    _out_opt(sp)
    sp.set_defaults(func=cmd_seal)
    sp = psub.add_parser("fmt", help="print a source or bundle in canonical form (--write, --check)")
    sp.add_argument("file")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite FILE")
    g.add_argument("--check", action="store_true", help="exit 1 when FILE is not in canonical form")
    _out_opt(sp)
    sp.set_defaults(func=cmd_fmt)
    sp = psub.add_parser("decompile", help="a bundle JSON as a policy source (YAML)")
    sp.add_argument("file")
    sp.add_argument("--out")
    _out_opt(sp)
    sp.set_defaults(func=cmd_decompile)
    sp = psub.add_parser("bump", help="the next version and publishedAt now (a source is edited in place, "
                                      "keeping its comments; a bundle is re-sealed)")
    sp.add_argument("file")
    sp.add_argument("--version", type=int)
    sp.add_argument("--published-at")
    _key_opt(sp)
    _out_opt(sp)
    sp.set_defaults(func=cmd_bump)
    sp = psub.add_parser("diff", help="rules and pools added, removed, tightened or loosened, per field, and "
                                      "the privileged bypasses (exit 7 when one is added or widened)")
    sp.add_argument("old")
    sp.add_argument("new")
    _out_opt(sp)
    sp.set_defaults(func=cmd_diff)
    sp = psub.add_parser("explain", help="the rules, keys, hash tags, slots and trace of one request")
    sp.add_argument("file", help="a bundle JSON or a policy source")
    sp.add_argument("--tenant")
    sp.add_argument("--principal", help="the principal id (a user or service id)")
    sp.add_argument("--principal-type", default="user", choices=("user", "service", "anonymous"))
    sp.add_argument("--api-key", help="the API key id the principal authenticated with")
    sp.add_argument("--route", required=True, help="the route group")
    sp.add_argument("--ip", help="the client address (an anonymous request when no --principal is given)")
    sp.add_argument("--cost", type=whole(1, 1000), default=1, help="the request's costHint, 1 to 1000 as the agent "
                                                                 "takes it (default: 1)")
    sp.add_argument("--pepper-file", help="your agents' pepper: keys as the agents derive them")
    _out_opt(sp)
    sp.set_defaults(func=cmd_explain)
    register_replay(psub)
    from .policy_canary import register as register_canary
    register_canary(psub, etcd_opts, _out_opt, _key_opt)


__all__ = ["EXIT_CANARY_WORSE", "emit", "fail", "policy_hints", "register"]


# ------------------------------------------------------------------------------ replay
def cmd_replay(args: argparse.Namespace) -> int:
    from . import replay as rp

    if not 0 <= args.threshold <= 1:
        return fail(args, "--threshold is a fraction in [0, 1] (0.05: five percentage points)")
    try:
        new = load_policy(args.new)
        current = load_policy(args.against) if args.against else None
        lines, bad = rp.read_log(args.log)
        if not lines:
            return fail(args, f"no decision lines in {', '.join(args.log)} ({bad} unreadable)")
        events = rp.expand(lines, args.max_events)
    except PolicyError as e:
        return fail(args, e)
    except rp.ReplayError as e:
        return fail(args, str(e))
    obs = rp.observed(lines)
    cur = rp.replay(current, events, f"bundle {current.bundle_version} ({args.against})") if current else obs
    res = rp.replay(new, events, f"bundle {new.bundle_version} ({args.new})")
    rows = rp.compare(obs, cur, res, args.threshold)
    doc = {"lines": len(lines), "questions": len(events), "unreadable": bad, "threshold": args.threshold,
           "current": cur.name, "new": res.name,
           "rules": [{"rule": r.rule, "questions": r.evaluated, "observed": r.observed, "current": r.current,
                      "new": r.new, "flag": r.flag or None} for r in rows]}
    emit(args, doc, rp.render(rows, obs, cur, res, args.threshold, len(lines), len(events), bad))
    return EXIT_CANARY_WORSE if any(r.flag == "up" for r in rows) else EXIT_OK


def register_replay(psub: Any) -> None:
    sp = psub.add_parser("replay", help="replay the sampled decision log through a bundle: the denial rate per "
                                        "rule under the current and the new bundle (exit 8 when a rule denies "
                                        "more by over --threshold)")
    sp.add_argument("new", help="the new bundle (JSON) or policy source (YAML)")
    sp.add_argument("--log", nargs="+", required=True, metavar="FILE", help="decision log files (rotated ones too)")
    sp.add_argument("--against", metavar="CURRENT", help="the current bundle (default: the outcomes the log recorded)")
    sp.add_argument("--threshold", type=float, default=0.05,
                    help="flag a rule whose denial rate changes by more than this fraction (default 0.05)")
    sp.add_argument("--max-events", type=int, default=5_000_000, help="bound on the questions replayed")
    _out_opt(sp)
    sp.set_defaults(func=cmd_replay)

"""``leasehold`` — operator CLI: run a local topology, ask it for decisions, look at leases, and
validate, sign and publish policy bundles.

Every command takes ``-o text`` (default, for people) or ``-o json`` (one JSON document on
stdout, also for errors); diagnostics go to stderr. Output and exit codes follow one convention
(:mod:`leasehold.commands.output`; docs/cli.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# A refusal is one line, the CLI's own (what failed, why, the exit code): grpc's core logged its
# TLS handshake failure to stderr first, and the etcd adapter's per-endpoint lines (for services,
# whose logging is configured) reached stderr through logging's last resort: four lines for one
# wrong CA. grpc's core is off unless GRPC_VERBOSITY asks for it.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
import uuid
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kernel.bundle import load_bundle_file
from kernel.errors import PolicyError
from kernel.version import version_line
from kernel.wire import PoolSummary, PoolWindowView, ShardedLeaderInfo

from ..local.topology import (
    DEFAULT_POLICY,
    LocalTopology,
    StateError,
    TokenFileError,
    TopologySpec,
    default_run_dir,
    read_state,
    read_token,
    same_boot,
    stop_from_state,
)
from .argtypes import etcd_prefix, finite, http_url, regions, whole
from .capacity_cli import register as register_capacity_command
from .output import Exit, Failure, Output, add_output_option, exit_code_epilog, out, run, write_file
from .policy_cli import register as register_policy_commands
from .token_cli import register as register_token_command

# the exit codes under their old names (scripts and tests import them)
EXIT_OK, EXIT_USAGE, EXIT_DENIED, EXIT_UNAVAILABLE, EXIT_CONNECT, EXIT_NOT_RUNNING = (
    Exit.OK, Exit.USAGE, Exit.DENIED, Exit.UNAVAILABLE, Exit.CONNECT, Exit.NOT_RUNNING)
EXIT_BYPASS = Exit.BYPASS
DEFAULT_RUN_DIR = default_run_dir()
# the local topology's sizes (`up`, `demo`): processes on one machine (decision 0061)
MAX_LOCAL_REGIONS, MAX_LOCAL_AGENTS, MAX_LOCAL_ALLOCATORS = 8, 16, 7


def _read_state(run_dir: Path) -> dict | None:
    """The running topology's state file, or None; one that is not a state file is exit 2."""
    try:
        return read_state(run_dir)
    except StateError as e:
        raise Failure(Exit.USAGE, str(e), [f"stop its processes by hand, then remove {run_dir / 'topology.json'}"],
                      runDir=str(run_dir)) from None


def _state_or_fail(run_dir: Path) -> dict:
    state = _read_state(run_dir)
    if state is None:
        raise Failure(Exit.NOT_RUNNING, f"no local topology is running (no {run_dir / 'topology.json'}); "
                                        "start one with `leasehold up`", running=False, runDir=str(run_dir))
    return state


_state_or_exit = _state_or_fail  # the name leasehold/commands/policy_canary.py uses


def _first_url(state: dict, kind: str, region: str | None = None) -> str:
    for svc in state["services"]:
        if svc["kind"] == kind and (region is None or svc.get("region") == region):
            return svc["url"]
    raise Failure(Exit.USAGE, f"no {kind} in the running topology" + (f" for region {region!r}" if region else ""))


def _invalid(e: PolicyError, what: str = "invalid") -> Failure:
    from .policy_cli import policy_hints
    return Failure(Exit.USAGE, f"{what}: {e.detail}", [*e.further, *policy_hints(e)])


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------- local topology
def _urls(services: list[dict]) -> dict[str, Any]:
    """The topology's URLs by role (what ``status -o json`` and ``up -o json`` print)."""
    urls: dict[str, Any] = {"agents": {}, "allocators": [], "etcd": [], "redis": {}}
    for s in services:
        if s["kind"] == "agent":
            urls["agents"].setdefault(s.get("region") or "", []).append(s["url"])
        elif s["kind"] == "allocator":
            urls["allocators"].append(s["url"])
        elif s["kind"] == "etcd":
            urls["etcd"].append(s["url"])
        elif s["kind"] == "redis":
            urls["redis"][s.get("region") or ""] = s["url"]
    return urls


def _topology_view(run_dir: Path, state: dict, services: list[dict]) -> dict[str, Any]:
    secrets = state.get("secrets")
    return {"runDir": str(run_dir), "stateFile": str(run_dir / "topology.json"), "policy": state.get("policy"),
            "auth": bool(secrets),
            "tokenFiles": ({"gateway": str(Path(secrets) / "gateway.token"),
                            "operator": str(Path(secrets) / "operator.token")} if secrets else None),
            "services": services, "urls": _urls(services)}


def _service_lines(services: list[dict], state_col: bool) -> str:
    rows = []
    for s in services:
        cols = f"{s['kind']:10} {s['name']:18} pid {s['pid']:<7} "
        if state_col:
            cols += f"{s['state']:10} "
        rows.append(cols + s["url"])
    return "\n".join(rows)


def _nothing_runs(run_dir: Path) -> None:
    """Before ``up`` / ``demo``: a topology whose processes run in ``run_dir`` is exit 2 (a second
    one would orphan them); a state file whose every process has exited (a crash, a reboot) is
    left over, and removed."""
    state = _read_state(run_dir)
    if state is None:
        return
    if same_boot(state) and any(_alive(int(s["pid"])) for s in state["services"]):
        raise Failure(Exit.USAGE, "a topology is already running; `leasehold down` first")
    (run_dir / "topology.json").unlink(missing_ok=True)


def cmd_up(args: argparse.Namespace) -> int:
    _nothing_runs(args.run_dir)
    LocalTopology(_spec(args)).start()
    state = _read_state(args.run_dir) or {}
    view = _topology_view(args.run_dir, state, [dict(s) for s in state.get("services", [])])
    return out(args).result(view, lambda v: _service_lines(v["services"], False)
                            + f"\nstate in {v['stateFile']}; stop with `leasehold down`")


def cmd_down(args: argparse.Namespace) -> int:
    _read_state(args.run_dir)  # a state file of another shape: exit 2 before any signal is sent
    stopped = stop_from_state(args.run_dir)
    return out(args).result({"stopped": stopped},
                            "stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed service whose parent, ``leasehold up``,
    is long gone stays a zombie until init reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal check is all we have
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _probe(client: httpx.Client, svc: dict, booted: bool = True) -> str:
    """``ready``, ``not ready`` (answers, but not ready), ``down`` (its process runs but does not
    answer) or ``exited`` (its process is gone, or ``booted`` is False: it ran before this boot)."""
    if not booted or not _alive(int(svc["pid"])):
        return "exited"
    kind, url = svc["kind"], svc["url"]
    try:
        if kind in ("agent", "allocator"):
            return "ready" if client.get(url + "/readyz").status_code == 200 else "not ready"
        if kind == "etcd":
            r = client.get(url + "/health")
            return "ready" if r.status_code == 200 and r.json().get("health") == "true" else "not ready"
        if kind == "redis":
            import socket
            from urllib.parse import urlsplit

            parts = urlsplit(url)
            with socket.create_connection((parts.hostname, parts.port or 6379), timeout=1.0):
                return "ready"
    except (httpx.HTTPError, OSError, ValueError):
        return "down"
    return "ready"


def cmd_status(args: argparse.Namespace) -> int:
    """Every process of the local topology and whether it is ready; exit 0 only when all are."""
    state = _state_or_fail(args.run_dir)
    with httpx.Client(timeout=1.0) as client:
        services = [{**svc, "state": _probe(client, svc, same_boot(state))} for svc in state["services"]]
    view = _topology_view(args.run_dir, state, services)
    bad = [s for s in services if s["state"] != "ready"]
    code = (Exit.CONNECT if any(s["state"] in ("down", "exited") for s in bad)
            else Exit.UNAVAILABLE if bad else Exit.OK)
    view = {"running": True, "healthy": not bad, **view}

    def text(v: dict) -> str:
        summary = ("all services ready" if not bad else
                   f"{len(bad)} of {len(services)} services not ready: " + ", ".join(
                       f"{s['name']} {s['state']}" for s in bad))
        return _service_lines(v["services"], True) + "\n" + summary

    return out(args).result(view, text, code)


# ----------------------------------------------------------------------- decisions and leases
def _auth_headers(args: argparse.Namespace, who: str) -> dict[str, str]:
    """Bearer token: LEASEHOLD_TOKEN, else the running local topology's generated one."""
    token = os.environ.get("LEASEHOLD_TOKEN")
    if not token:
        state = _read_state(args.run_dir)
        try:
            token = read_token(state, who) if state else None
        except TokenFileError as e:
            raise Failure(Exit.USAGE, str(e), ["set LEASEHOLD_TOKEN to the token, or restart the topology "
                                               "(`leasehold down`, then `leasehold up`)"]) from None
    return {"Authorization": f"Bearer {token}"} if token else {}


def _decision_text(d: dict) -> str:
    verdict = "allowed" if d.get("allowed") else "denied"
    limited = (f"no rule of bundle {d.get('policyVersion')} applies" if d.get("allowed") and not d.get("policyId")
               else f"rule {d.get('policyId') or '-'} (bundle {d.get('policyVersion')}), remaining "
                    f"{d.get('remaining')} of {d.get('limit')}")
    lines = [f"{verdict}: HTTP {d.get('httpStatus', 200)}, {limited}"
             + (f", reason {d['reason']}" if d.get("reason") else "")
             + (f", retry after {d['retryAfterMs']} ms" if d.get("retryAfterMs") not in (None, 0) else "")
             + (" (fallback)" if d.get("fallback") else "")]
    lines += [f"  {k}: {v}" for k, v in (d.get("headers") or {}).items()]
    lines.append(f"  decision {d.get('decisionId')}")
    return "\n".join(lines)


def cmd_admit(args: argparse.Namespace) -> int:
    url = args.agent_url or _first_url(_state_or_fail(args.run_dir), "agent", args.region)
    principal: dict[str, str] = {"type": args.principal_type, "id": args.principal}
    if args.api_key:
        principal["apiKeyId"] = args.api_key
    body: dict[str, object] = {"requestId": args.request_id or f"cli-{uuid.uuid4().hex[:16]}",
                               "principal": principal, "routeGroup": args.route, "method": args.method,
                               "costHint": args.cost}
    if args.tenant:
        body["tenantId"] = args.tenant
    try:
        resp = httpx.post(url + "/v1/admit", json=body, timeout=5.0, headers=_auth_headers(args, "gateway"))
    except httpx.HTTPError as e:
        raise Failure(Exit.CONNECT, f"cannot reach the agent at {url}: {e}") from None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):  # not an agent's answer (a decision and a problem are objects)
        data = {"body": resp.text[:500]}
        if resp.status_code == 200:
            raise Failure(Exit.USAGE, f"the answer of {url} is not a decision: is {url} an agent?", [data["body"]],
                          problem=data)
    if resp.status_code != 200:
        code = Exit.USAGE if resp.status_code < 500 else Exit.UNAVAILABLE
        said = data.get("detail") or data.get("title") or ""  # the detail says what; the title only its class
        raise Failure(code, f"the agent answered {resp.status_code}" + (f": {said}" if said else ""),
                      [x for x in data.get("errors") or [] if str(x) not in said], problem=data)
    status = data.get("httpStatus", 200)
    code = Exit.OK if status == 200 else Exit.DENIED if status == 429 else Exit.UNAVAILABLE
    return out(args).result(data, _decision_text, code)


def _leases_text(v: dict) -> str:
    leader = v["leader"]
    lines = [f"leader: {leader.get('nodeId') or 'none'} epoch {leader.get('epoch')} at {leader.get('url') or '-'}"]
    for p in v["pools"]:
        if "window" not in p:
            lines.append(f"pool {p.get('pool', '?')}: {p}")
            continue
        w = p["window"]
        lines.append(f"pool {p['pool']}: window {w.get('index')}, granted {p['granted']:,} of {p['limit']:,} "
                     f"(remaining {p['remaining']:,}), {p['leasesOutstanding']} leases outstanding")
        lines += [f"  {r['region']}: granted {r['granted']:,} in {r['leases']} leases, returned {r.get('returned', 0):,}"
                  for r in p.get("regions", [])]
    return "\n".join(lines)


def cmd_leases(args: argparse.Namespace) -> int:
    url = args.allocator_url or _first_url(_state_or_fail(args.run_dir), "allocator")
    try:
        with httpx.Client(timeout=3.0) as client:
            def get(path: str, shape: Any) -> Any:
                r = client.get(url + path)
                if r.status_code != 200:
                    raise Failure(Exit.UNAVAILABLE if r.status_code >= 500 else Exit.USAGE,
                                  f"the allocator at {url} answered {r.status_code} for {path}", [r.text[:300]])
                try:
                    data = r.json()
                    msgspec.convert(data, shape)  # only checked: the answer is printed as it came
                except (ValueError, msgspec.ValidationError) as e:
                    raise Failure(Exit.USAGE, f"the answer of {url} to {path} is not an allocator's: is "
                                              f"{url} an allocator?", [f"{e}", r.text[:300]]) from None
                return data

            leader = get("/v1/leader", ShardedLeaderInfo)
            pools = get("/v1/pools", list[PoolSummary])
            views = [get(f"/v1/pools/{p['id']}", PoolWindowView) for p in pools]
    except httpx.HTTPError as e:
        raise Failure(Exit.CONNECT, f"cannot reach the allocator at {url}: {e}") from None
    return out(args).result({"leader": leader, "pools": views}, _leases_text)


# ----------------------------------------------------------------------- policy bundles
def cmd_policy_validate(args: argparse.Namespace) -> int:
    """Validate FILE (the services' own code); with ``--public-keys`` also its signature, first; with
    ``--against CURRENT`` / ``--against-etcd`` the privileged bypasses it adds or widens."""
    import asyncio

    from kernel.bypass import diff_bypasses, needs_review
    from kernel.errors import LeaseholdError
    from kernel.policy_yaml import load_policy
    from kernel.signing import TrustedKeys

    o = out(args)
    try:
        # a policy source is checked as the bundle it compiles to; with --public-keys a bundle's signature
        # is verified first, as the services do: one that does not verify is refused for that alone
        trusted = TrustedKeys.from_files(_split(args.public_keys)) if args.public_keys else None
        bundle = load_policy(args.file, verify=trusted.check if trusted is not None else None)
    except PolicyError as e:
        raise _invalid(e) from None
    result: dict[str, Any] = {
        "valid": True, "file": args.file, "bundleVersion": bundle.bundle_version, "rules": len(bundle.rules),
        "pools": len(bundle.pools), "checksum": bundle.checksum, "keyId": bundle.key_id,
        "trusted": bool(args.public_keys)}
    signed = f", signed by key {bundle.key_id}" if bundle.key_id else ", unsigned"
    if bundle.key_id and not args.public_keys:  # what the file says, not checked: a stale or forged one reads alike
        signed += " (signature not checked: --public-keys checks it)"
    lines = [f"valid: bundle {bundle.bundle_version}, {len(bundle.rules)} rules, {len(bundle.pools)} pools, "
             f"{bundle.checksum}{signed}{' (trusted)' if args.public_keys else ''}"]
    if args.bound:
        import msgspec

        from kernel.bound import Topology, hot_chunk_terms, pool_bound, pool_shapes

        from .bound_report import cases, markdown_table, text_report

        if not (1 <= args.regions <= 64 and 1 <= args.agents_per_region <= 1024):
            raise Failure(Exit.USAGE, "invalid: --regions must be in [1, 64] and --agents-per-region in [1, 1024]")
        names = [f"region-{i + 1}" for i in range(args.regions)]
        topology = Topology.uniform(names, args.agents_per_region)
        result["bound"] = [{"pool": shape.id, **{name: msgspec.to_builtins(pool_bound(shape, topology, f))
                                                 for name, f in zip(("healthy", "allocatorUnreachable", "worst"),
                                                                    (f for _, f in cases(topology)), strict=True)}}
                           for shape in pool_shapes(bundle)]
        result["hotChunks"] = [{"rule": rule.id, **msgspec.to_builtins(term)}
                               for rule, term in hot_chunk_terms(bundle, topology)]
        from kernel.bound import approximate_bounds, split_bounds

        def camel(row: Any) -> dict[str, Any]:
            return {k.split("_")[0] + "".join(w.title() for w in k.split("_")[1:]): v
                    for k, v in row._asdict().items()} | {"formula": row.formula}

        result["approximate"] = [camel(b) for b in approximate_bounds(bundle, args.agents_per_region)]
        result["splits"] = [camel(s) for s in split_bounds(bundle)]
        if args.markdown:
            lines.append(markdown_table(bundle, names, sorted({1, args.agents_per_region})))
        else:
            lines.append(text_report(bundle, topology))
    if not (args.against or args.against_etcd):
        return o.result(result, "\n".join(lines))
    if args.against:
        try:
            current = load_policy(args.against)
        except PolicyError as e:
            raise Failure(Exit.USAGE, f"the current bundle {args.against} is unusable: {e.detail}", e.errors) from None
        where = args.against
    else:
        async def read():
            store = _policy_store(args)
            try:
                await store.trust_marker()  # verified first with the marker's keys, as the services do with theirs
                return await store.read(), store.key.decode()
            finally:
                await store.store.close()
        try:
            stored, where = asyncio.run(read())
        except LeaseholdError as e:
            raise Failure(Exit.CONNECT, f"cannot read the current bundle from etcd ({e.code}): {e.detail}") from None
        if stored is not None and stored.bundle is None:
            o.note(f"leasehold: the bundle published at {where} is "
                   + (f"invalid ({stored.problem})" if stored.outcome == "invalid"
                      else f"refused ({stored.outcome}): {stored.problem}") + "; comparing against nothing")
        current = stored.bundle if stored is not None else None
        if current is not None:  # what publish would say of it, before the operator asks it
            result["publishable"] = bundle.bundle_version > current.bundle_version
            if not result["publishable"]:
                lines.append(f"not publishable as is: bundle {bundle.bundle_version} is not above the published "
                             f"{current.bundle_version} (`leasehold policy bump` it, after carrying over what the "
                             "published one changed)")
    changes = diff_bypasses(current, bundle)
    version = current.bundle_version if current is not None else "none"
    review = needs_review(changes)
    result["against"] = {"where": where, "bundleVersion": current.bundle_version if current is not None else None}
    result["bypassChanges"] = [{"kind": c.kind, "rule": c.rule, "tenant": c.tenant, "owner": c.owner,
                                "details": list(c.details)} for c in changes]
    result["review"] = review
    if not changes:
        lines.append(f"privileged bypasses: no change against {where} (bundle {version})")
    else:
        lines.append(f"privileged bypasses against {where} (bundle {version}):")
        lines += ["  " + c.line().replace("\n", "\n  ") for c in changes]
    if review:
        o.note("REVIEW: this bundle adds or widens a privileged bypass (exit 7)")
    return o.result(result, "\n".join(lines), Exit.BYPASS if review else Exit.OK)


def cmd_policy_keygen(args: argparse.Namespace) -> int:
    from kernel.signing import generate_keypair, key_id_of, load_public_key

    try:
        key, pub = generate_keypair(Path(args.dir), args.name, replace=args.force)
    except FileExistsError as e:
        raise Failure(Exit.USAGE, f"{e}: refusing to replace a signing key pair (bundles signed with it would no "
                                  "longer verify with a new one); another --name or DIR, or --force") from None
    except OSError as e:
        raise Failure(Exit.USAGE, f"cannot write the key pair into {args.dir}: {e.strerror}") from None
    data = {"keyId": key_id_of(load_public_key(pub)), "privateKey": str(key), "publicKey": str(pub)}
    return out(args).result(data, lambda d: f"key {d['keyId']}: private {d['privateKey']}, public {d['publicKey']}")


def cmd_policy_sign(args: argparse.Namespace) -> int:
    """Sign FILE with the Ed25519 key (validated first); writes ``--out`` or FILE in place."""
    from kernel.bundle import encode_bundle
    from kernel.signing import load_private_key, sign_bundle

    try:
        bundle = load_bundle_file(args.file)
        signed = sign_bundle(bundle, load_private_key(args.key))
    except PolicyError as e:
        raise _invalid(e) from None
    target = Path(args.out or args.file)
    write_file(target, encode_bundle(signed) + b"\n")
    data = {"bundleVersion": signed.bundle_version, "keyId": signed.key_id, "file": str(target)}
    return out(args).result(data, f"signed bundle {signed.bundle_version} with key {signed.key_id} -> {target}")


def _policy_store(args: argparse.Namespace):
    """The policy store of ``--etcd`` (TLS from ``--etcd-ca-file`` / ``--etcd-cert-file`` /
    ``--etcd-key-file`` or an ``https://`` endpoint), or of the running local topology."""
    from kernel.config import ConfigError, check_tls
    from kernel.etcd_store import EtcdStore
    from kernel.etcd_tls import link_credentials
    from kernel.policy_store import PolicyStore

    endpoints, user, password_file = args.etcd, args.etcd_user, args.etcd_password_file
    if not endpoints:  # the running local topology: its etcd and, with auth on, the publisher's user
        state = _state_or_fail(args.run_dir)
        endpoints = ",".join(s["url"] for s in state["services"] if s["kind"] == "etcd")
        if state.get("secrets") and not user:  # write on the policy key only (deploy/etcd/leasehold-roles.sh)
            user, password_file = "publisher", str(Path(state["secrets"]) / "etcd-publisher.password")
    for flag, path in (("--etcd-ca-file", args.etcd_ca_file), ("--etcd-cert-file", args.etcd_cert_file),
                       ("--etcd-key-file", args.etcd_key_file)):
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise Failure(Exit.USAGE, f"{flag} {path}: " + ("not a readable file" if os.path.exists(path)
                                                             else "no such file"))
    try:
        check_tls("--etcd-cert-file / --etcd-key-file / --etcd-ca-file", args.etcd_cert_file, args.etcd_key_file,
                  args.etcd_ca_file)
        tls = link_credentials(endpoints, args.etcd_ca_file, args.etcd_cert_file, args.etcd_key_file)
    except ConfigError as e:
        raise Failure(Exit.USAGE, e.message) from None
    except (ValueError, OSError) as e:
        raise Failure(Exit.USAGE, f"invalid etcd settings: {e}") from None
    password = os.environ.get("LEASEHOLD_ETCD_PASSWORD")
    if password_file:
        try:
            with open(password_file) as f:
                password = f.read().strip()
        except OSError as e:
            raise Failure(Exit.USAGE, f"cannot read --etcd-password-file {password_file}: {e.strerror}") from None
    kw = {"user": user, "password": password} if user else {}
    return PolicyStore(EtcdStore(endpoints, timeout_s=3.0, tls=tls, **kw), args.prefix)


def cmd_policy_publish(args: argparse.Namespace) -> int:
    """Validate FILE and publish it to etcd if its version is strictly higher than the stored one.
    Rollback: publish the old bundle under a new, higher version (``--as-version N`` re-seals it).

    Signatures: ``--key KEY`` signs the bundle (after any ``--as-version``) before publishing.
    When the fleet requires signatures — the signing marker ``<prefix>policy/signing`` exists
    (``leasehold policy require-signed``), or ``--require-signature`` is given — an unsigned bundle,
    or one that does not verify with the marker's keys, is refused here (exit 2), before any
    agent or allocator would refuse it."""
    import asyncio

    import msgspec

    from kernel.bundle import decode_bundle, encode_bundle, read_bundle_bytes
    from kernel.errors import Conflict, LeaseholdError, StoreUnavailable
    from kernel.policy_store import VersionSkip, rollback_bundle
    from kernel.signing import load_private_key, sign_bundle

    try:
        raw = read_bundle_bytes(args.file)
        bundle = decode_bundle(raw)
        if args.as_version is not None:
            published = args.published_at or bundle.published_at
            bundle = rollback_bundle(bundle, args.as_version, published)
            raw = encode_bundle(bundle)
        # the running local topology's key signs what is unsigned (a file signed by another key keeps it)
        key = args.key or (_topology_signing_key(args) if bundle.signature is None else None)
        if key:
            bundle = sign_bundle(bundle, load_private_key(key))
            raw = encode_bundle(bundle)
    except OSError as e:
        raise Failure(Exit.USAGE, f"cannot read {args.file}: {e.strerror}") from None
    except PolicyError as e:
        raise _invalid(e) from None
    except msgspec.ValidationError as e:
        raise Failure(Exit.USAGE, f"invalid: {e}") from None

    async def publish() -> dict:
        store = _policy_store(args)
        try:
            try:
                marker = await store.check_signed(bundle)
                if marker is None and args.require_signature and bundle.signature is None:
                    raise PolicyError("the bundle is unsigned and --require-signature was given (sign it with --key)")
                # what is published is read as the services trusting the marker's keys read it: a value none of
                # them signed is not the bundle they hold (the published version says which they do)
                await store.trust_marker()
                res = await store.publish(raw, over=args.over, next_only=True)
            except PolicyError as e:
                raise Failure(Exit.USAGE, f"not published: {e.detail}", e.further) from None
            except StoreUnavailable as e:
                raise Failure(Exit.CONNECT, f"not published: cannot reach etcd ({e.detail})") from None
            except VersionSkip as e:  # which bundle this file was made over is the operator's to say
                raise Failure(Exit.DENIED, f"not published ({e.code}): {e.detail}", [
                    "if this file was made over the published bundle (`leasehold policy show --raw > published.json` "
                    f"and `leasehold policy diff published.json {args.file}` show what it changes), publish it with "
                    "--over <the published version>; else carry the published bundle's changes over first"]) from None
            except Conflict as e:  # another publish got there first: its changes are not in this file
                raise Failure(Exit.DENIED, f"not published ({e.code}): {e.detail}", [
                    "the published bundle may hold changes this file does not: `leasehold policy show --raw > "
                    f"published.json` and `leasehold policy diff published.json {args.file}`, carry them over, then "
                    "bump this file above it (bumping alone would take them back)"]) from None
            except LeaseholdError as e:
                raise Failure(Exit.UNAVAILABLE if e.retriable else Exit.DENIED,
                              f"not published ({e.code}): {e.detail}") from None
            try:  # published: a canary staged beside it is what the operator must hear of, never a failure
                staged = (await store.read_both())[1]
            except LeaseholdError:
                staged = None
        finally:
            await store.store.close()
        canary = None if staged is None else {
            "version": staged.bundle.bundle_version if staged.bundle else None, "base": staged.base,
            "slice": staged.slice.text() if staged.slice else None}
        return {"published": res.version, "previous": res.previous, "revision": res.revision,
                "key": store.key.decode(), "keyId": bundle.key_id, "replacedInvalid": res.replaced or None,
                "lastPublished": res.held, "canary": canary}

    data = asyncio.run(publish())
    if (c := data["canary"]) is not None:
        above = c["version"] is not None and c["version"] > data["published"]
        out(args).note(f"leasehold: note: a canary is staged (bundle {c['version']} for {c['slice']}, over {c['base']}): "
                       + ("its slice keeps evaluating it, not this bundle" if above else "its slice drops it for this "
                          "bundle") + "; `policy promote` refuses it now: roll it back, or stage a candidate above "
                       f"{data['published']} that carries this publish's changes")
    def text(d: dict) -> str:
        if d["previous"] is not None:
            previous = f"previous {d['previous']}"
        else:  # over an empty key or an invalid value, above the last bundle published (when one was)
            previous = ("over an empty key" if d["replacedInvalid"] is None
                        else f"over an invalid value: {d['replacedInvalid']}")
            if d["lastPublished"] is not None:
                previous += f"; bundle {d['lastPublished']} was the last published"
            elif d["replacedInvalid"] is None:
                previous = "the first"
        return (f"published bundle {d['published']} ({previous}) at {d['key']}, revision {d['revision']}"
                + (f", signed by key {d['keyId']}" if d["keyId"] else ", unsigned"))

    return out(args).result(data, text)


def _topology_signing_key(args: argparse.Namespace) -> str | None:
    """Publishing to the running local topology (no --etcd): its generated signing key."""
    if args.etcd:
        return None
    state = _read_state(args.run_dir)
    return state.get("signingKey") if state else None


def cmd_policy_require_signed(args: argparse.Namespace) -> int:
    """Write (or with ``--clear`` delete) the signing marker: the public keys the fleet trusts,
    so that ``policy publish`` refuses what the services would refuse."""
    import asyncio

    from kernel.errors import LeaseholdError
    from kernel.policy_store import SigningMarker
    from kernel.signing import key_id_of, load_public_key, public_key_text

    if not args.clear and not args.public_keys:
        raise Failure(Exit.USAGE, "give --public-keys A.pub[,B.pub] (or --clear)")
    try:
        keys = [load_public_key(p) for p in _split(args.public_keys or "")]
    except PolicyError as e:
        raise _invalid(e) from None
    marker = None if args.clear else SigningMarker(keys={key_id_of(k): public_key_text(k) for k in keys})

    async def write() -> dict:
        store = _policy_store(args)
        try:
            await store.write_signing(marker)
        except LeaseholdError as e:
            raise Failure(Exit.CONNECT, f"not written ({e.code}): {e.detail}") from None
        finally:
            await store.store.close()
        return {"key": store.signing_key.decode(), "requireSigned": marker is not None,
                "keyIds": sorted(marker.keys) if marker else []}

    data = asyncio.run(write())
    return out(args).result(data, lambda d: (f"{d['key']}: bundles must be signed by one of {', '.join(d['keyIds'])}"
                                             if d["requireSigned"] else f"{d['key']}: removed; signatures not "
                                                                        "required by the store"))


def _refused_text(d: dict) -> str:
    """A value ``policy show`` refuses: ``INVALID`` (its validation), or its signature outcome (verified first,
    with the signing marker's keys: the value was not validated)."""
    if d["refused"] in (None, "invalid"):
        return f"INVALID: {d['problem']}"
    return f"REFUSED ({d['refused']}): {d['problem']}"


def _shown_text(d: dict) -> str:
    lines = [f"{d['key']} (revision {d['revision']}): " + (
        f"bundle {d['bundleVersion']}, {len(d['rules'])} rules, {len(d['pools'])} pools, {d['checksum']}"
        if d["valid"] else _refused_text(d))]
    if d["valid"]:
        lines.append(f"  published at {d['publishedAt']}, "
                     + ("no max age, " if d["maxAgeMs"] is None else f"max age {d['maxAgeMs']} ms, ")
                     + (f"signed by key {d['keyId']}" if d["keyId"] else "unsigned"))
        lines.append("  rules: " + ", ".join(d["rules"]))
        if d["pools"]:
            lines.append("  pools: " + ", ".join(d["pools"]))
    if (c := d["canary"]) is not None:  # some agents evaluate another bundle than the one above
        lines.append("  canary: " + (f"bundle {c['bundleVersion']}" if c["valid"] else _refused_text(c))
                     + f" staged for {c['slice']} over {c['base']} (`leasehold policy status`)")
    lines.append("  signatures required: " + (", ".join(d["trustedKeyIds"]) if d["requireSigned"] else "no")
                 + (f" (signing marker unreadable: {d['signingMarkerProblem']})" if d["signingMarkerProblem"] else ""))
    return "\n".join(lines)


def cmd_policy_show(args: argparse.Namespace) -> int:
    """The published bundle and the staged canary. With a signing marker their signatures are verified
    with its keys before they are validated: a value no key of it signed is shown refused with its
    signature outcome (``unsigned``, ``untrusted_key``, ``bad_signature``), as a service trusting those
    keys counts it, whatever else is wrong with it."""
    import asyncio

    from kernel.errors import LeaseholdError

    async def read() -> tuple[Any, Any, Any, str | None, str, str]:
        store = _policy_store(args)
        try:
            # verified with the marker's keys first, as the services verify with theirs
            marker, marker_problem = await store.trust_marker()
            stored, staged = await store.read_both()
        except LeaseholdError as e:
            raise Failure(Exit.CONNECT, f"cannot read ({e.code}): {e.detail}") from None
        finally:
            await store.store.close()
        return stored, staged, marker, marker_problem, store.key.decode(), store.canary_key.decode()

    stored, staged, marker, marker_problem, key, canary_key = asyncio.run(read())
    if stored is None:
        raise Failure(Exit.NOT_RUNNING, f"nothing published under {key}", key=key)
    if args.raw:
        if out(args).json:
            return out(args).result({"key": key, "text": stored.raw.decode(errors="replace")})
        sys.stdout.write(stored.raw.decode(errors="replace"))
        return Exit.OK
    b = stored.bundle
    data = {"key": key, "revision": stored.mod_revision, "valid": b is not None,
            "problem": stored.problem or None, "refused": None if b is not None else stored.outcome,
            "bundleVersion": b.bundle_version if b else None, "checksum": b.checksum if b else None,
            "publishedAt": b.published_at if b else None, "maxAgeMs": b.max_age_ms if b else None,
            "keyId": b.key_id if b else None,
            "rules": [r.id for r in b.rules] if b else [], "pools": [p.id for p in b.pools] if b else [],
            "requireSigned": marker is not None, "trustedKeyIds": sorted(marker.keys) if marker else [],
            "signingMarkerProblem": marker_problem,
            "canary": None if staged is None else {
                "valid": staged.bundle is not None, "problem": staged.problem or None,
                "refused": None if staged.bundle is not None else staged.outcome,
                "bundleVersion": staged.bundle.bundle_version if staged.bundle else None, "base": staged.base,
                "slice": staged.slice.text() if staged.slice else None}}
    # a value the services refuse is not what a script checking the exit status may take for a healthy fleet
    refused = [w for w, d in ((key, data), (canary_key, data["canary"])) if d is not None and not d["valid"]]
    if refused:  # the document all the same, with the error a failing command's JSON carries
        o = out(args)
        message = (f"the value {'published' if refused[0] == key else 'staged'} at {refused[0]} is not a bundle the "
                   "services take: they keep the bundle they hold (exit 2)")
        data["error"] = {"exit": int(Exit.USAGE), "kind": Exit.USAGE.name.lower(), "message": message}
        code = o.result(data, _shown_text, Exit.USAGE)
        o.note(f"leasehold: {message}")
        return code
    return out(args).result(data, _shown_text)


# ----------------------------------------------------------------------- secrets
def cmd_secrets_generate(args: argparse.Namespace) -> int:
    """Every credential of a deployment as files (leasehold/commands/secrets.py); never replaces one without --force."""
    from .secrets import SecretsError, generate

    if not args.out.strip():  # Path("") is the working directory
        raise Failure(Exit.USAGE, "--out is empty: name the directory the credentials go to")
    try:
        made = generate(Path(args.out), args.regions, force=args.force)
    except SecretsError as e:
        raise Failure(Exit.USAGE, str(e)) from None
    except OSError as e:  # the disk, a quota, a permission: nothing was put in place (generate is all or nothing)
        raise Failure(Exit.USAGE, f"cannot write the credentials to {args.out}: {e.strerror or e}; "
                                  f"{args.out} is as it was") from None
    data = {"dir": str(made.dir), "files": [p.name for p in made.files]}
    return out(args).result(data, lambda d: f"wrote {len(d['files'])} files to {d['dir']} (directory 0700; "
                                            f"policy-signing.key and dev-idp.key 0600): {', '.join(d['files'])}\n"
                                            f"dev-idp.key and jwks.json are a development identity provider's "
                                            f"(leasehold token signs with the key): use your provider's JWKS in "
                                            f"production")


# ----------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from ..local.demo import run_demo

    _nothing_runs(args.run_dir)  # a second topology in the same run directory would orphan the first's processes

    # -o json: the live view goes to stderr and the run's totals are one JSON document on stdout
    return run_demo(_spec(args), duration_s=args.duration, rate=args.rate, summary=out(args).json,
                    gateway=args.gateway)


def _spec(args: argparse.Namespace) -> TopologySpec:
    """The topology ``up`` / ``demo`` start, its start bundle read and checked first: nothing is
    started or written for a bundle the services would refuse."""
    if len(args.regions) > MAX_LOCAL_REGIONS:
        raise Failure(Exit.USAGE, f"--regions: at most {MAX_LOCAL_REGIONS} regions on one machine, "
                                  f"not {len(args.regions)}")
    try:
        load_bundle_file(args.policy)
    except PolicyError as e:
        raise _invalid(e, f"--policy {args.policy}") from None
    return TopologySpec(run_dir=args.run_dir, policy=Path(args.policy).resolve(),
                        regions=args.regions, agents_per_region=args.agents_per_region,
                        allocators=args.allocators, etcd_members=args.etcd_members,
                        auth=not getattr(args, "no_auth", False), policy_from_etcd=True,
                        signed=not getattr(args, "unsigned", False),
                        decision_logs=getattr(args, "decision_logs", False),
                        insecure_dev_pepper=getattr(args, "insecure_dev_pepper", False))


# ------------------------------------------------------------------------------- parser
_JSON_USAGE: ContextVar[bool] = ContextVar("json_usage_errors", default=False)


def _asks_json(argv: Sequence[str]) -> bool:
    """``-o json`` / ``--output json`` (or ``=json``, ``-ojson``) anywhere before ``--``: a usage
    error is then also the JSON error document on stdout, like every other failure."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a in ("-ojson", "-o=json", "--output=json") or (a in ("-o", "--output") and argv[i + 1:i + 2] == ["json"]):
            return True
    return False


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors like every other failure (``leasehold: ...``, with
    ``-o json`` the JSON error document too; exit 2)."""

    def error(self, message: str):
        Output("json" if _JSON_USAGE.get() else "text").failure(
            Failure(Exit.USAGE, f"{message} (see {self.prog} --help)"))
        raise SystemExit(Exit.USAGE)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30)


def _command(sub: Any, name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A subcommand with the common options (``-o``); every command is added through here."""
    sp = sub.add_parser(name, help=help, description=help, formatter_class=_formatter)
    add_output_option(sp)
    sp.set_defaults(func=func)
    return sp


def _topo_opts(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--policy", default=str(DEFAULT_POLICY), help="the start bundle (default: the shipped sample)")
    sp.add_argument("--regions", type=regions, default=("eu", "us"),
                    help=f"comma-separated region names, 1 to {MAX_LOCAL_REGIONS} (default: eu,us)")
    sp.add_argument("--agents-per-region", type=whole(1, MAX_LOCAL_AGENTS), default=1,
                    help=f"agents per region, 1 to {MAX_LOCAL_AGENTS} (default: 1)")
    sp.add_argument("--allocators", type=whole(1, MAX_LOCAL_ALLOCATORS), default=2,
                    help=f"allocator replicas, 1 to {MAX_LOCAL_ALLOCATORS} (default: 2)")
    sp.add_argument("--etcd-members", type=int, default=1, choices=(1, 3), help="etcd members (default: 1)")
    sp.add_argument("--no-auth", action="store_true",
                    help="run the services with --auth-disabled (default: tokens generated into <run-dir>/secrets)")
    sp.add_argument("--unsigned", action="store_true",
                    help="no policy signing (default: a key pair in <run-dir>/secrets signs the start bundle "
                         "and the services trust only its public key)")
    sp.add_argument("--decision-logs", action="store_true",
                    help="every agent writes the sampled decision log, <run-dir>/decisions-<region>-<n>.jsonl, "
                         "the input of `leasehold policy replay` (default: off)")
    sp.add_argument("--insecure-dev-pepper", action="store_true",
                    help="give the agents the public development pepper (default: a random pepper "
                         "generated into <run-dir>/secrets/pepper)")


def _etcd_opts(sp: argparse.ArgumentParser) -> None:
    """How a policy command reaches etcd (flags, or ``LEASEHOLD_ETCD*`` environment variables)."""
    env = os.environ.get
    sp.add_argument("--etcd", default=env("LEASEHOLD_ETCD"),
                    help="etcd endpoints, host:port, http://host:port or https://host:port, comma-separated "
                         "(env LEASEHOLD_ETCD; default: the running local topology's, with its publisher "
                         "credentials)")
    sp.add_argument("--prefix", type=etcd_prefix, default=env("LEASEHOLD_ETCD_PREFIX", "/leasehold/"),
                    help="the fleet's key prefix (env LEASEHOLD_ETCD_PREFIX; default: /leasehold/)")
    sp.add_argument("--etcd-user", default=env("LEASEHOLD_ETCD_USER"),
                    help="etcd user (env LEASEHOLD_ETCD_USER); password from --etcd-password-file or "
                         "LEASEHOLD_ETCD_PASSWORD")
    sp.add_argument("--etcd-password-file", default=env("LEASEHOLD_ETCD_PASSWORD_FILE"),
                    help="file holding the etcd password (env LEASEHOLD_ETCD_PASSWORD_FILE)")
    sp.add_argument("--etcd-ca-file", default=env("LEASEHOLD_ETCD_CA_FILE"),
                    help="TLS: the CA (PEM) that signed etcd's certificate; implies TLS (env "
                         "LEASEHOLD_ETCD_CA_FILE; default for https://: grpc's public roots)")
    sp.add_argument("--etcd-cert-file", default=env("LEASEHOLD_ETCD_CERT_FILE"),
                    help="TLS: client certificate (PEM) for etcd's --client-cert-auth (env LEASEHOLD_ETCD_CERT_FILE)")
    sp.add_argument("--etcd-key-file", default=env("LEASEHOLD_ETCD_KEY_FILE"),
                    help="TLS: the private key of --etcd-cert-file (env LEASEHOLD_ETCD_KEY_FILE)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="leasehold", description="Leasehold's operator CLI: run a local topology, ask it for decisions, look at\n"
                                               "leases, validate, sign and publish policy bundles.",
                epilog=exit_code_epilog() + "\n\nMore: docs/cli.md", formatter_class=_formatter)
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help=f"where the local topology keeps its files (default: {DEFAULT_RUN_DIR})")
    add_output_option(p, top=True)
    p.add_argument("--version", action="version", version=version_line("leasehold"),
                   help="print the version and build commit, and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    # -- the local topology
    sp = _command(sub, "up", "start the local topology in the background", cmd_up)
    _topo_opts(sp)
    _command(sub, "down", "stop every process of the local topology", cmd_down)
    _command(sub, "status", "processes of the local topology, their URLs and readiness (exit 0 only when "
                            "every one is ready)", cmd_status)
    sp = _command(sub, "demo", "start the topology, drive demo traffic, show a live view (Ctrl-C stops)", cmd_demo)
    _topo_opts(sp)
    sp.add_argument("--duration", type=finite(0, above=True), default=600.0,
                    help="stop by itself after this many seconds (default: 600)")
    sp.add_argument("--rate", type=finite(0), default=200.0,
                    help="demo requests per second, all regions (default: 200)")
    sp.add_argument("--gateway", choices=("rls", "rlqs"), default="rls",
                    help="the Envoys' limit filter: rls (deploy/gateways/envoy-rls.yaml, a call per request) or "
                         "rlqs (envoy-rlqs.yaml: Envoy decides locally from quota the agent assigns; the live "
                         "view shows the assignments per bucket)")

    # -- decisions and leases
    sp = _command(sub, "admit", "send one admission request and print the decision and HTTP mapping", cmd_admit)
    sp.add_argument("--agent-url", type=http_url, help="the agent (default: the running local topology's first, or --region's)")
    sp.add_argument("--region", help="pick the local topology's agent of this region")
    sp.add_argument("--tenant", default="atlas", help="tenantId (default: atlas)")
    sp.add_argument("--principal", default="U-17", help="principal id (default: U-17)")
    sp.add_argument("--principal-type", default="user", choices=("user", "service", "anonymous"),
                    help="principal type (default: user)")
    sp.add_argument("--api-key", help="principal apiKeyId")
    sp.add_argument("--route", default="read", help="routeGroup (default: read)")
    sp.add_argument("--method", default="GET", help="HTTP method (default: GET)")
    sp.add_argument("--cost", type=whole(1, 1000), default=1, help="costHint, 1 to 1000 as the agent takes it (default: 1)")
    sp.add_argument("--request-id", help="requestId (default: a random cli-... id)")
    sp = _command(sub, "leases", "pools, windows, grants and the leader epoch from the allocator", cmd_leases)
    sp.add_argument("--allocator-url", type=http_url, help="the allocator (default: the running local topology's first)")

    # -- policy bundles
    pol = sub.add_parser("policy", help="validate, sign, publish or show a policy bundle",
                         description="validate, sign, publish or show a policy bundle", formatter_class=_formatter)
    psub = pol.add_subparsers(dest="policy_command", required=True, metavar="COMMAND", parser_class=_Parser)
    add_policy_commands(psub)
    register_token_command(sub, _command)  # leasehold/commands/token_cli.py: a client token from the development key

    # -- deployment credentials
    sec = sub.add_parser("secrets", help="credentials for a deployment (compose, Kubernetes)",
                         description="credentials for a deployment (compose, Kubernetes)", formatter_class=_formatter)
    ssub = sec.add_subparsers(dest="secrets_command", required=True, metavar="COMMAND", parser_class=_Parser)
    sp = _command(ssub, "generate", "write tokens, their digests, the pepper, Redis and etcd passwords, a "
                                    "policy-signing key pair and a development identity provider's key and "
                                    "JWKS into DIR (never replaces a file without --force)",
                  cmd_secrets_generate)
    sp.add_argument("--out", required=True, metavar="DIR",
                    help="e.g. deploy/secrets (compose) or deploy/k8s-dev/secrets (Kubernetes)")
    sp.add_argument("--regions", type=regions, default=("eu", "us"),
                    help="comma-separated region names, one allocator token each (default: eu,us)")
    sp.add_argument("--force", action="store_true", help="replace existing files")
    register_capacity_command(sub)  # leasehold/commands/capacity_cli.py: Redis shards, memory per copy, the hottest key
    return p


def add_policy_commands(psub: Any) -> None:
    """The ``leasehold policy ...`` commands (each through :func:`_command`)."""
    sp = _command(psub, "validate", "validate a bundle with the services' own code; optionally its signature and "
                                    "the privileged bypasses it adds or widens", cmd_policy_validate)
    sp.add_argument("file", help="a bundle JSON, or a policy source (YAML: checked as the bundle it compiles to)")
    sp.add_argument("--public-keys", help="PEM public keys (comma-separated): the bundle must be signed by one")
    sp.add_argument("--against", metavar="CURRENT", help="the bundle in force (a file): report bypass changes, "
                                                         "exit 7 if a bypass is added or widened")
    sp.add_argument("--against-etcd", action="store_true", help="the same against the bundle published in etcd")
    sp.add_argument("--bound", action="store_true",
                    help="also print each pool's overshoot bound per window, term by term")
    sp.add_argument("--regions", type=int, default=2, help="regions for --bound (default 2)")
    sp.add_argument("--agents-per-region", type=int, default=1,
                    help="agent processes per region for --bound, an agent with --workers N counting N (default 1)")
    sp.add_argument("--markdown", action="store_true", help="--bound as a Markdown table (text output)")
    _etcd_opts(sp)
    sp = _command(psub, "keygen", "generate an Ed25519 signing key pair (NAME.key 0600, NAME.pub)", cmd_policy_keygen)
    sp.add_argument("dir")
    sp.add_argument("--name", default="policy-signing", help="file name stem (default: policy-signing)")
    sp.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    sp = _command(psub, "sign", "sign a bundle (keyId + signature over content, version, publishedAt)",
                  cmd_policy_sign)
    sp.add_argument("file")
    sp.add_argument("--key", required=True, help="Ed25519 private key (PEM, unencrypted)")
    sp.add_argument("--out", help="write here instead of rewriting FILE")
    sp = _command(psub, "publish", "validate and publish a bundle to etcd (strictly higher version only; rollback = "
                                   "old content under a new version, see --as-version)", cmd_policy_publish)
    sp.add_argument("file")
    sp.add_argument("--as-version", type=int, help="publish FILE's rules and pools under this version "
                                                   "(re-sealed checksum): the rollback path")
    sp.add_argument("--published-at", help="publishedAt for --as-version")
    sp.add_argument("--over", type=int, metavar="VERSION",
                    help="the published bundle this one was made over: published only while it is the published one "
                         "(needed when the version skips past the next one; default: the version below this one)")
    sp.add_argument("--key", help="sign with this Ed25519 private key before publishing (default, against the "
                                  "running local topology: its generated key, for an unsigned FILE)")
    sp.add_argument("--require-signature", action="store_true",
                    help="refuse an unsigned bundle even without the etcd signing marker")
    _etcd_opts(sp)
    sp = _command(psub, "require-signed", "declare in etcd that the fleet requires bundles signed by these keys "
                                          "(publish then refuses others); --clear removes it",
                  cmd_policy_require_signed)
    sp.add_argument("--public-keys", help="PEM public keys, comma-separated (two during a rotation)")
    sp.add_argument("--clear", action="store_true", help="remove the requirement")
    _etcd_opts(sp)
    sp = _command(psub, "show", "the bundle published in etcd", cmd_policy_show)
    sp.add_argument("--raw", action="store_true", help="print the stored JSON as is")
    _etcd_opts(sp)
    register_policy_commands(psub, _etcd_opts)  # leasehold/commands/policy_cli.py: compile, seal, diff, replay, canary, ...


def _command_parsers(parser: argparse.ArgumentParser) -> None:
    """Each command's parser as its ``_parser`` default, so that an option it does not have is
    reported with that command's ``--help`` (argparse reports it from the top-level parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.set_defaults(_parser=sp)
                _command_parsers(sp)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not logging.getLogger().handlers:  # run as the CLI: libraries' log lines are not its output
        logging.getLogger().addHandler(logging.NullHandler())
    token = _JSON_USAGE.set(_asks_json(argv))
    try:
        parser = build_parser()
        _command_parsers(parser)
        args, extra = parser.parse_known_args(argv)
        if extra:
            own = {s for a in parser._actions for s in a.option_strings}  # leasehold's own: --run-dir, --version
            misplaced = [x.split("=", 1)[0] for x in extra if x.split("=", 1)[0] in own]
            if misplaced:
                parser.error(f"{misplaced[0]} is an option of leasehold, not of {getattr(args, '_parser', parser).prog}: "
                             "give it before the command")
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    finally:
        _JSON_USAGE.reset(token)
    return run(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())

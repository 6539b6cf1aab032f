"""``leasehold`` — operator CLI.

Exit codes (for scripts): 0 success / allowed, 2 bad usage or invalid input (an invalid,
unsigned or wrongly signed bundle included), 3 a request was denied (429), 4 the limiter or
allocator answered unavailable (503), 5 could not connect, 6 the local topology is not running,
7 the bundle is valid but adds or widens a privileged bypass (``policy validate --against``).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

import httpx

from kernel.bundle import load_bundle_file
from kernel.errors import PolicyError

from .capacity_cli import register as register_capacity_command
from .policy_cli import register as register_policy_commands
from .topology import (
    DEFAULT_POLICY,
    LocalTopology,
    TopologySpec,
    default_run_dir,
    read_state,
    read_token,
    stop_from_state,
)

EXIT_OK, EXIT_USAGE, EXIT_DENIED, EXIT_UNAVAILABLE, EXIT_CONNECT, EXIT_NOT_RUNNING = 0, 2, 3, 4, 5, 6
EXIT_BYPASS = 7
DEFAULT_RUN_DIR = default_run_dir()


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _state_or_exit(run_dir: Path) -> dict:
    state = read_state(run_dir)
    if state is None:
        print(f"no local topology is running (no {run_dir / 'topology.json'}); start one with `leasehold up`",
              file=sys.stderr)
        raise SystemExit(EXIT_NOT_RUNNING)
    return state


def _first_url(state: dict, kind: str, region: str | None = None) -> str:
    for svc in state["services"]:
        if svc["kind"] == kind and (region is None or svc.get("region") == region):
            return svc["url"]
    print(f"no {kind} in the running topology" + (f" for region {region!r}" if region else ""), file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


# ------------------------------------------------------------------------------- commands
def cmd_up(args: argparse.Namespace) -> int:
    if read_state(args.run_dir):
        print("a topology is already running; `leasehold down` first", file=sys.stderr)
        return EXIT_USAGE
    topo = LocalTopology(_spec(args)).start()
    for svc in topo.services():
        print(f"{svc.kind:10} {svc.name:18} pid {svc.pid:<7} {svc.url}")
    print(f"state in {args.run_dir / 'topology.json'}; stop with `leasehold down`")
    return EXIT_OK


def cmd_down(args: argparse.Namespace) -> int:
    stopped = stop_from_state(args.run_dir)
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    state = _state_or_exit(args.run_dir)
    rows = []
    with httpx.Client(timeout=1.0) as client:
        for svc in state["services"]:
            ready = "-"
            if svc["kind"] in ("agent", "allocator"):
                try:
                    ready = "ready" if client.get(svc["url"] + "/readyz").status_code == 200 else "not ready"
                except httpx.HTTPError:
                    ready = "down"
            rows.append({**svc, "ready": ready})
    for r in rows:
        print(f"{r['kind']:10} {r['name']:18} pid {r['pid']:<7} {r['ready']:10} {r['url']}")
    return EXIT_OK


def cmd_admit(args: argparse.Namespace) -> int:
    url = args.agent_url or _first_url(_state_or_exit(args.run_dir), "agent", args.region)
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
        print(f"cannot reach the agent at {url}: {e}", file=sys.stderr)
        return EXIT_CONNECT
    data = resp.json()
    _print(data)
    if resp.status_code != 200:
        return EXIT_USAGE if resp.status_code < 500 else EXIT_UNAVAILABLE
    status = data.get("httpStatus", 200)
    return EXIT_OK if status == 200 else EXIT_DENIED if status == 429 else EXIT_UNAVAILABLE


def _auth_headers(args: argparse.Namespace, who: str) -> dict[str, str]:
    """Bearer token: LEASEHOLD_TOKEN, else the running local topology's generated one."""
    import os

    token = os.environ.get("LEASEHOLD_TOKEN")
    if not token:
        state = read_state(args.run_dir)
        token = read_token(state, who) if state else None
    return {"Authorization": f"Bearer {token}"} if token else {}


def cmd_leases(args: argparse.Namespace) -> int:
    url = args.allocator_url or _first_url(_state_or_exit(args.run_dir), "allocator")
    try:
        with httpx.Client(timeout=3.0) as client:
            leader = client.get(url + "/v1/leader").json()
            pools = client.get(url + "/v1/pools").json()
            views = []
            for p in pools if isinstance(pools, list) else pools.get("pools", []):
                r = client.get(f"{url}/v1/pools/{p['id']}")
                views.append(r.json())
    except httpx.HTTPError as e:
        print(f"cannot reach the allocator at {url}: {e}", file=sys.stderr)
        return EXIT_CONNECT
    _print({"leader": leader, "pools": views})
    return EXIT_OK


def _invalid(e: PolicyError) -> int:
    print(f"invalid: {e.detail}", file=sys.stderr)
    for problem in e.errors:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_USAGE


def cmd_policy_validate(args: argparse.Namespace) -> int:
    """Validate FILE (the services' own code); with ``--public-keys`` also its signature; with
    ``--against CURRENT`` / ``--against-etcd`` the privileged bypasses it adds or widens."""
    import asyncio

    from kernel.bypass import diff_bypasses, needs_review
    from kernel.errors import LeaseholdError
    from kernel.signing import TrustedKeys

    try:
        bundle = load_bundle_file(args.file)
        if args.public_keys:
            TrustedKeys.from_files(_split(args.public_keys)).check(bundle)
    except PolicyError as e:
        return _invalid(e)
    signed = f", signed by key {bundle.key_id}" if bundle.key_id else ", unsigned"
    print(f"valid: bundle {bundle.bundle_version}, {len(bundle.rules)} rules, {len(bundle.pools)} pools, "
          f"{bundle.checksum}{signed}{' (trusted)' if args.public_keys else ''}")
    if args.bound:
        from kernel.bound import Topology

        from .bound_report import markdown_table, text_report

        if not (1 <= args.regions <= 64 and 1 <= args.agents_per_region <= 1024):
            print("invalid: --regions must be in [1, 64] and --agents-per-region in [1, 1024]", file=sys.stderr)
            return EXIT_USAGE
        names = [f"region-{i + 1}" for i in range(args.regions)]
        if args.markdown:
            print(markdown_table(bundle, names, sorted({1, args.agents_per_region})))
        else:
            print(text_report(bundle, Topology.uniform(names, args.agents_per_region)))
    if not (args.against or args.against_etcd):
        return EXIT_OK
    if args.against:
        try:
            current = load_bundle_file(args.against)
        except PolicyError as e:
            print(f"the current bundle {args.against} is unusable: {e.detail}", file=sys.stderr)
            return EXIT_USAGE
        where = args.against
    else:
        async def read():
            store = _policy_store(args)
            try:
                return await store.read(), store.key.decode()
            finally:
                await store.store.close()
        try:
            stored, where = asyncio.run(read())
        except LeaseholdError as e:
            print(f"cannot read the current bundle from etcd ({e.code}): {e.detail}", file=sys.stderr)
            return EXIT_CONNECT
        if stored is not None and stored.bundle is None:
            print(f"the bundle published at {where} is invalid ({stored.problem}); comparing against nothing",
                  file=sys.stderr)
        current = stored.bundle if stored is not None else None
    changes = diff_bypasses(current, bundle)
    version = current.bundle_version if current is not None else "none"
    if not changes:
        print(f"privileged bypasses: no change against {where} (bundle {version})")
        return EXIT_OK
    print(f"privileged bypasses against {where} (bundle {version}):")
    for c in changes:
        print("  " + c.line().replace("\n", "\n  "))
    if needs_review(changes):
        print("REVIEW: this bundle adds or widens a privileged bypass (exit 7)", file=sys.stderr)
        return EXIT_BYPASS
    return EXIT_OK


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_policy_keygen(args: argparse.Namespace) -> int:
    from kernel.signing import generate_keypair, key_id_of, load_public_key

    key, pub = generate_keypair(Path(args.dir), args.name)
    _print({"keyId": key_id_of(load_public_key(pub)), "privateKey": str(key), "publicKey": str(pub)})
    return EXIT_OK


def cmd_policy_sign(args: argparse.Namespace) -> int:
    """Sign FILE with the Ed25519 key (validated first); writes ``--out`` or FILE in place."""
    from kernel.bundle import encode_bundle
    from kernel.signing import load_private_key, sign_bundle

    try:
        bundle = load_bundle_file(args.file)
        signed = sign_bundle(bundle, load_private_key(args.key))
    except PolicyError as e:
        return _invalid(e)
    out = Path(args.out or args.file)
    out.write_bytes(encode_bundle(signed) + b"\n")
    print(f"signed bundle {signed.bundle_version} with key {signed.key_id} -> {out}")


def _policy_store(args: argparse.Namespace):
    import os

    from kernel.etcd_store import EtcdStore
    from kernel.policy_store import PolicyStore
    endpoints, user, password_file = args.etcd, args.etcd_user, args.etcd_password_file
    if not endpoints:  # the running local topology: its etcd and, with auth on, the publisher's user
        state = _state_or_exit(args.run_dir)
        endpoints = ",".join(s["url"].removeprefix("http://") for s in state["services"] if s["kind"] == "etcd")
        if state.get("secrets") and not user:  # write on the policy key only (deploy/etcd/leasehold-roles.sh)
            user, password_file = "publisher", str(Path(state["secrets"]) / "etcd-publisher.password")
    password = os.environ.get("LEASEHOLD_ETCD_PASSWORD")
    if password_file:
        with open(password_file) as f:
            password = f.read().strip()
    kw = {"user": user, "password": password} if user else {}
    return PolicyStore(EtcdStore(endpoints, timeout_s=3.0, **kw), args.prefix)


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

    from kernel.bundle import decode_bundle, encode_bundle
    from kernel.errors import LeaseholdError
    from kernel.policy_store import rollback_bundle
    from kernel.signing import TrustedKeys, load_private_key, public_key_from_text, sign_bundle

    try:
        with open(args.file, "rb") as f:
            raw = f.read()
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
        print(f"cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except PolicyError as e:
        return _invalid(e)
    except msgspec.ValidationError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return EXIT_USAGE

    async def run() -> int:
        store = _policy_store(args)
        marker = None
        try:
            marker = await store.read_signing()
            if marker is not None:
                TrustedKeys(public_key_from_text(v) for v in marker.keys.values()).check(bundle)
            elif args.require_signature and bundle.signature is None:
                raise PolicyError("the bundle is unsigned and --require-signature was given (sign it with --key)")
            res = await store.publish(raw)
        except PolicyError as e:
            print(f"not published: {e.detail}", file=sys.stderr)
            if marker is not None:
                print(f"  the fleet requires bundles signed by one of: {', '.join(sorted(marker.keys))} "
                      f"({store.signing_key.decode()}); sign with --key", file=sys.stderr)
            return EXIT_USAGE
        except LeaseholdError as e:
            print(f"not published ({e.code}): {e.detail}", file=sys.stderr)
            return EXIT_UNAVAILABLE if e.retriable else EXIT_DENIED
        finally:
            await store.store.close()
        _print({"published": res.version, "previous": res.previous, "revision": res.revision,
                "key": store.key.decode(), "keyId": bundle.key_id})
        return EXIT_OK

    return asyncio.run(run())


def _topology_signing_key(args: argparse.Namespace) -> str | None:
    """Publishing to the running local topology (no --etcd): its generated signing key."""
    if args.etcd:
        return None
    state = read_state(args.run_dir)
    return state.get("signingKey") if state else None


def cmd_policy_require_signed(args: argparse.Namespace) -> int:
    """Write (or with ``--clear`` delete) the signing marker: the public keys the fleet trusts,
    so that ``policy publish`` refuses what the services would refuse."""
    import asyncio

    from kernel.errors import LeaseholdError
    from kernel.policy_store import SigningMarker
    from kernel.signing import key_id_of, load_public_key, public_key_text

    if not args.clear and not args.public_keys:
        print("give --public-keys A.pub[,B.pub] (or --clear)", file=sys.stderr)
        return EXIT_USAGE
    try:
        keys = [load_public_key(p) for p in _split(args.public_keys or "")]
    except PolicyError as e:
        return _invalid(e)
    marker = None if args.clear else SigningMarker(keys={key_id_of(k): public_key_text(k) for k in keys})

    async def run() -> int:
        store = _policy_store(args)
        try:
            await store.write_signing(marker)
        except LeaseholdError as e:
            print(f"not written ({e.code}): {e.detail}", file=sys.stderr)
            return EXIT_CONNECT
        finally:
            await store.store.close()
        _print({"key": store.signing_key.decode(), "requireSigned": marker is not None,
                "keyIds": sorted(marker.keys) if marker else []})
        return EXIT_OK

    return asyncio.run(run())


def cmd_policy_show(args: argparse.Namespace) -> int:
    import asyncio

    from kernel.errors import LeaseholdError

    async def run() -> int:
        store = _policy_store(args)
        try:
            stored = await store.read()
            try:
                marker = await store.read_signing()
            except PolicyError as e:
                marker, marker_problem = None, e.detail
            else:
                marker_problem = None
        except LeaseholdError as e:
            print(f"cannot read ({e.code}): {e.detail}", file=sys.stderr)
            return EXIT_CONNECT
        finally:
            await store.store.close()
        if stored is None:
            print(f"nothing published under {store.key.decode()}", file=sys.stderr)
            return EXIT_NOT_RUNNING
        if args.raw:
            sys.stdout.write(stored.raw.decode(errors="replace"))
            return EXIT_OK
        b = stored.bundle
        _print({"key": store.key.decode(), "revision": stored.mod_revision, "valid": b is not None,
                "problem": stored.problem or None,
                "bundleVersion": b.bundle_version if b else None, "checksum": b.checksum if b else None,
                "publishedAt": b.published_at if b else None, "maxAgeMs": b.max_age_ms if b else None,
                "keyId": b.key_id if b else None,
                "rules": [r.id for r in b.rules] if b else [], "pools": [p.id for p in b.pools] if b else [],
                "requireSigned": marker is not None, "trustedKeyIds": sorted(marker.keys) if marker else [],
                "signingMarkerProblem": marker_problem})
        return EXIT_OK

    return asyncio.run(run())


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_spec(args), duration_s=args.duration, rate=args.rate)


def _spec(args: argparse.Namespace) -> TopologySpec:
    return TopologySpec(run_dir=args.run_dir, policy=Path(args.policy).resolve(),
                        regions=tuple(args.regions.split(",")), agents_per_region=args.agents_per_region,
                        allocators=args.allocators, etcd_members=args.etcd_members,
                        auth=not getattr(args, "no_auth", False), policy_from_etcd=True,
                        signed=not getattr(args, "unsigned", False),
                        insecure_dev_pepper=getattr(args, "insecure_dev_pepper", False))


# ------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leasehold", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where the local topology keeps its files")
    sub = p.add_subparsers(dest="command", required=True)

    def topo_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--policy", default=str(DEFAULT_POLICY))
        sp.add_argument("--regions", default="eu,us")
        sp.add_argument("--agents-per-region", type=int, default=1)
        sp.add_argument("--allocators", type=int, default=2)
        sp.add_argument("--etcd-members", type=int, default=1, choices=(1, 3))
        sp.add_argument("--no-auth", action="store_true",
                        help="run the services with --auth-disabled true (default: tokens generated into "
                             "<run-dir>/secrets)")
        sp.add_argument("--unsigned", action="store_true",
                        help="no policy signing (default: a key pair in <run-dir>/secrets signs the start bundle "
                             "and the services trust only its public key)")
        sp.add_argument("--insecure-dev-pepper", action="store_true",
                        help="give the agents the public development pepper (default: a random pepper "
                             "generated into <run-dir>/secrets/pepper)")

    sp = sub.add_parser("up", help="start the local topology in the background")
    topo_opts(sp)
    sp.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop every process of the local topology").set_defaults(func=cmd_down)
    sub.add_parser("status", help="processes of the local topology and their readiness").set_defaults(func=cmd_status)

    sp = sub.add_parser("admit", help="send one admission request and print the decision and HTTP mapping")
    sp.add_argument("--agent-url")
    sp.add_argument("--region")
    sp.add_argument("--tenant", default="atlas")
    sp.add_argument("--principal", default="U-17")
    sp.add_argument("--principal-type", default="user", choices=("user", "service", "anonymous"))
    sp.add_argument("--api-key")
    sp.add_argument("--route", default="read")
    sp.add_argument("--method", default="GET")
    sp.add_argument("--cost", type=int, default=1)
    sp.add_argument("--request-id")
    sp.set_defaults(func=cmd_admit)

    sp = sub.add_parser("leases", help="pools, windows, grants and the leader epoch from the allocator")
    sp.add_argument("--allocator-url")
    sp.set_defaults(func=cmd_leases)

    pol = sub.add_parser("policy", help="validate, publish or show a policy bundle")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    def etcd_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--etcd", help="etcd endpoints, host:port[,host:port...] (default: the running local "
                                       "topology's, with its publisher credentials)")
        sp.add_argument("--prefix", default="/leasehold/", help="the allocator's key prefix")
        sp.add_argument("--etcd-user", help="etcd user (password from --etcd-password-file or "
                                           "LEASEHOLD_ETCD_PASSWORD)")
        sp.add_argument("--etcd-password-file")

    sp = psub.add_parser("validate", help="validate a bundle with the services' own code; optionally its "
                                          "signature and the privileged bypasses it adds or widens")
    sp.add_argument("file")
    sp.add_argument("--public-keys", help="PEM public keys (comma-separated): the bundle must be signed by one")
    sp.add_argument("--against", metavar="CURRENT", help="the bundle in force (a file): report bypass changes, "
                                                         "exit 7 if a bypass is added or widened")
    sp.add_argument("--against-etcd", action="store_true", help="the same against the bundle published in etcd")
    sp.add_argument("--bound", action="store_true",
                    help="also print each pool's overshoot bound per window, term by term (kernel.bound)")
    sp.add_argument("--regions", type=int, default=2, help="regions for --bound (default 2)")
    sp.add_argument("--agents-per-region", type=int, default=1, help="agents per region for --bound (default 1)")
    sp.add_argument("--markdown", action="store_true", help="--bound as the README's Markdown table")
    etcd_opts(sp)
    sp.set_defaults(func=cmd_policy_validate)
    sp = psub.add_parser("keygen", help="generate an Ed25519 signing key pair (NAME.key 0600, NAME.pub)")
    sp.add_argument("dir")
    sp.add_argument("--name", default="policy-signing")
    sp.set_defaults(func=cmd_policy_keygen)
    sp = psub.add_parser("sign", help="sign a bundle (keyId + signature over content, version, publishedAt)")
    sp.add_argument("file")
    sp.add_argument("--key", required=True, help="Ed25519 private key (PEM, unencrypted)")
    sp.add_argument("--out", help="write here instead of rewriting FILE")
    sp.set_defaults(func=cmd_policy_sign)
    sp = psub.add_parser("publish", help="validate and publish a bundle to etcd (strictly higher version only; "
                                         "rollback = old content under a new version, see --as-version)")
    sp.add_argument("file")
    sp.add_argument("--as-version", type=int, help="publish FILE's rules and pools under this version "
                                                   "(re-sealed checksum): the rollback path")
    sp.add_argument("--published-at", help="publishedAt for --as-version")
    sp.add_argument("--key", help="sign with this Ed25519 private key before publishing (default, against the "
                                  "running local topology: its generated key, for an unsigned FILE)")
    sp.add_argument("--require-signature", action="store_true",
                    help="refuse an unsigned bundle even without the etcd signing marker")
    etcd_opts(sp)
    sp.set_defaults(func=cmd_policy_publish)
    sp = psub.add_parser("require-signed", help="declare in etcd that the fleet requires bundles signed by these "
                                                "keys (publish then refuses others); --clear removes it")
    sp.add_argument("--public-keys", help="PEM public keys, comma-separated (two during a rotation)")
    sp.add_argument("--clear", action="store_true")
    etcd_opts(sp)
    sp.set_defaults(func=cmd_policy_require_signed)
    sp = psub.add_parser("show", help="the bundle published in etcd")
    sp.add_argument("--raw", action="store_true", help="print the stored JSON as is")
    etcd_opts(sp)
    sp.set_defaults(func=cmd_policy_show)
    register_policy_commands(psub, etcd_opts)  # leasehold/policy_cli.py: compile, seal, diff, replay, canary, ...

    register_capacity_command(sub)  # leasehold/capacity_cli.py: Redis shards, memory, the hottest key
    sp = sub.add_parser("demo", help="start the topology, drive demo traffic, show a live view (Ctrl-C stops)")
    topo_opts(sp)
    sp.add_argument("--duration", type=float, default=600.0, help="stop by itself after this many seconds")
    sp.add_argument("--rate", type=float, default=200.0, help="demo requests per second, all regions")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

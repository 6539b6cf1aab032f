#!/bin/sh
# Leasehold's etcd users and roles (least privilege), then authentication on. Idempotent, and safe
# to re-run against a live cluster: no service loses a permission it keeps.
#
#   role                  user        permissions (under the prefix P, default /leasehold/)
#   leasehold-publisher   publisher   readwrite  P policy/current          (the policy key,
#                                     readwrite  P policy/canary            the staged candidate
#                                     readwrite  P policy/signing           the signing marker
#                                     readwrite  P policy/published-version the last version published, only)
#   leasehold-allocator   allocator   readwrite  P pools/ P grants/ P members/ (prefixes), P leader
#                                                (prefix: the key and, sharded, leader/<shard>),
#                                                P shards, P compaction (keys);
#                                     read       P policy/ (prefix)
#   (and etcd's Compact call, which etcd 3.5 allows any authenticated user: allocator/compaction.py)
#   leasehold-agent       agent       read       P policy/ (prefix)
#   root                  root        etcd's own administrator (used only by this script)
#
# `leasehold policy publish` uses the publisher; the allocator cannot publish a bundle and the
# agents cannot write anything. Used by `leasehold up` (leasehold/local/topology.py runs this file),
# deploy/docker-compose.yml (service etcd-init) and deploy/k8s/etcd-roles-job.yaml.
#
# Environment: ETCDCTL_ENDPOINTS (and ETCDCTL_CACERT/CERT/KEY for TLS: etcdctl reads them),
# LEASEHOLD_PREFIX, and one password file per user: ROOT_PASSWORD_FILE, PUBLISHER_PASSWORD_FILE,
# ALLOCATOR_PASSWORD_FILE, AGENT_PASSWORD_FILE. Passwords go to etcdctl on stdin, never on a
# command line. Once authentication is on, a second run authenticates as root.
#
# Exit status: 0 done; 2 a setting is missing or wrong (the prefix, a password file); 3 etcd does
# not answer at ETCDCTL_ENDPOINTS within 10 s; another etcdctl's own (its message says why).
set -eu
P=${LEASEHOLD_PREFIX:-/leasehold/}
case "$P" in /*/) ;; *) echo "LEASEHOLD_PREFIX must start and end with /" >&2; exit 2 ;; esac
for v in ROOT_PASSWORD_FILE PUBLISHER_PASSWORD_FILE ALLOCATOR_PASSWORD_FILE AGENT_PASSWORD_FILE; do
  eval "f=\${$v:-}"
  [ -n "$f" ] || { echo "$v is not set: the file holding that etcd user's password" >&2; exit 2; }
  [ -s "$f" ] || { echo "missing password file $f ($v)" >&2; exit 2; }
done
export ETCDCTL_API=3

# etcdctl retries `user list` for ever against endpoints nobody answers: bounded, so a wrong
# ETCDCTL_ENDPOINTS is named rather than waited on
if timeout 10 etcdctl user list >/dev/null 2>&1; then
  :
elif [ $? -eq 124 ]; then
  echo "etcd does not answer at ${ETCDCTL_ENDPOINTS:-127.0.0.1:2379} (etcdctl user list: no answer in 10 s)" >&2
  exit 3
else  # authentication is already on: act as root
  ETCDCTL_USER="root:$(cat "$ROOT_PASSWORD_FILE")"
  export ETCDCTL_USER
fi

ensure_user() {  # name password-file role
  if ! etcdctl user get "$1" >/dev/null 2>&1; then
    etcdctl user add "$1" --interactive=false < "$2" >/dev/null
  fi
  etcdctl user grant-role "$1" "$3" >/dev/null
}

# A role is never deleted and re-added: deleting it revokes it from its users, and the running
# allocators and agents would be refused (permission denied) until the script granted it again.
# Its permissions are made exactly the granted ones in place: each grant is set (a grant replaces a
# permission's type), then prune_role revokes what no grant of this run named.
ensure_role() {  # name: created when missing
  if ! etcdctl role get "$1" >/dev/null 2>&1; then
    etcdctl role add "$1" >/dev/null
  fi
}

WANT=""
grant() {  # role perm key [prefix]
  if [ "${4:-}" = prefix ]; then
    etcdctl role grant-permission "$1" "$2" "$3" --prefix=true >/dev/null
  else
    etcdctl role grant-permission "$1" "$2" "$3" >/dev/null
  fi
  WANT="$WANT
$1 ${4:-key} $3"
}

TAB=$(printf '\t')
prune_role() {  # name: revoke every permission of the role that no grant above named
  etcdctl role get "$1" | sed -n "s/^$TAB//p" | sort -u | while IFS= read -r perm; do
    case "$perm" in  # etcdctl's lines: KEY | [KEY, END) (prefix KEY) | [KEY, END) | [KEY, <open ended>
      *") (prefix "*")") key=${perm##*(prefix }; key=${key%)}; mode=prefix ;;
      "["*", <open ended>") key=${perm#\[}; key=${key%, <open ended>}; mode=from-key ;;
      "["*")") key=${perm#\[}; end=${key#*, }; end=${end%)}; key=${key%%, *}; mode=range ;;
      *) key=$perm; mode=key ;;
    esac
    if printf '%s\n' "$WANT" | grep -qxF "$1 $mode $key"; then
      continue
    fi
    case "$mode" in
      prefix) etcdctl role revoke-permission "$1" "$key" --prefix=true ;;
      from-key) etcdctl role revoke-permission "$1" "$key" --from-key=true ;;
      range) etcdctl role revoke-permission "$1" "$key" "$end" ;;
      *) etcdctl role revoke-permission "$1" "$key" ;;
    esac >/dev/null
  done
}

if ! etcdctl user get root >/dev/null 2>&1; then
  etcdctl user add root --interactive=false < "$ROOT_PASSWORD_FILE" >/dev/null
fi
etcdctl user grant-role root root >/dev/null

ensure_role leasehold-publisher
grant leasehold-publisher readwrite "${P}policy/current"
grant leasehold-publisher readwrite "${P}policy/signing"  # the signing marker publish checks (kernel.policy_store)
grant leasehold-publisher readwrite "${P}policy/canary"  # a staged candidate and its slice (docs/policy.md)
grant leasehold-publisher readwrite "${P}policy/published-version"  # written with every bundle (kernel.policy_store)
prune_role leasehold-publisher

ensure_role leasehold-allocator
grant leasehold-allocator readwrite "${P}pools/" prefix
grant leasehold-allocator readwrite "${P}grants/" prefix
grant leasehold-allocator readwrite "${P}leader" prefix  # leader, and leader/<shard> when sharded
grant leasehold-allocator readwrite "${P}members/" prefix  # sharded: the live replicas
grant leasehold-allocator readwrite "${P}shards"  # sharded: the deployment's shard count
grant leasehold-allocator readwrite "${P}compaction"  # the last compaction record (allocator/compaction.py)
grant leasehold-allocator read "${P}policy/" prefix
prune_role leasehold-allocator

ensure_role leasehold-agent
grant leasehold-agent read "${P}policy/" prefix
prune_role leasehold-agent

ensure_user publisher "$PUBLISHER_PASSWORD_FILE" leasehold-publisher
ensure_user allocator "$ALLOCATOR_PASSWORD_FILE" leasehold-allocator
ensure_user agent "$AGENT_PASSWORD_FILE" leasehold-agent

etcdctl auth enable >/dev/null
echo "etcd roles for ${P}: publisher, allocator, agent; authentication on"

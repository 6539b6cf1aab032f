"""Our RESP packing of EVALSHA (region_agent.store.resp.pack_evalsha) sends byte for byte
what redis-py's own packer sends for the same arguments (no server needed: both are encoders)."""

from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from region_agent.store.resp import pack_evalsha

_arg = st.one_of(st.text(max_size=40), st.integers(min_value=-(2**63), max_value=2**63),
                 st.binary(max_size=20))


@given(keys=st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=6),
       argv=st.lists(_arg, max_size=40))
def test_pack_evalsha_matches_redis_py(keys, argv):
    sha = "0123456789abcdef0123456789abcdef01234567"
    expected = b"".join(Connection().pack_command("EVALSHA", sha, len(keys), *keys, *argv))
    assert pack_evalsha(sha, keys, argv) == expected



@given(calls=st.lists(st.tuples(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3),
                                st.lists(_arg, max_size=12)), max_size=5))
def test_a_pipeline_packs_as_its_calls_one_after_another(calls):
    from region_agent.store.resp import pack_pipeline

    sha = "0123456789abcdef0123456789abcdef01234567"
    expected = b"".join(b"".join(Connection().pack_command("EVALSHA", sha, len(k), *k, *a)) for k, a in calls)
    assert pack_pipeline([(sha, k, a) for k, a in calls]) == expected


# strings of any length up to past the packer's table of bulk headers (512 bytes)
_str = st.one_of(st.text(max_size=30), st.text(alphabet="ab", min_size=505, max_size=520))
_ruled = st.tuples(st.lists(st.one_of(st.text(min_size=1, max_size=30), _str), min_size=1, max_size=4),
                   st.integers(min_value=-5, max_value=10**6), st.integers(min_value=0, max_value=10**6),
                   _str, _str)


@given(rules=st.lists(_arg, max_size=12), calls=st.lists(_ruled, min_size=1, max_size=4))
def test_a_multi_rule_call_packs_from_its_shape_format_as_redis_py_would(rules, calls):
    """A multi-rule call's ARGV (RuleArgv) is packed from its shape's text memoised per shape: the
    same bytes as redis-py's packer, for '%' in any part, non-ASCII strings, strings longer than
    the table of bulk headers, and rule slots the fast path cannot take (bytes); the same rule
    tuple serves several calls (the memo is hit)."""
    from region_agent.decision.call import RuleArgv
    from region_agent.store.resp import pack_pipeline

    sha = "0123456789abcdef0123456789abcdef01234567"
    slots = tuple(rules)
    packed = []
    for keys, slack, ttl, member, question in calls:
        argv = RuleArgv((slack, ttl, member, *slots, question))
        argv.rules, argv.text = slots, None  # as call.prechecked_call makes one without a remembered question
        packed.append((sha, keys, argv))
    expected = b"".join(b"".join(Connection().pack_command("EVALSHA", sha, len(k), *k, *a)) for _, k, a in packed)
    assert pack_pipeline(packed) == expected
    assert pack_pipeline(packed) == expected  # from the memo

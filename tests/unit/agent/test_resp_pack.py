"""Our RESP packing of EVALSHA (region_agent.store.scripts.pack_evalsha) sends byte for byte
what redis-py's own packer sends for the same arguments (no server needed: both are encoders)."""

from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from region_agent.store.scripts import pack_evalsha

_arg = st.one_of(st.text(max_size=40), st.integers(min_value=-(2**63), max_value=2**63),
                 st.binary(max_size=20))


@given(keys=st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=6),
       argv=st.lists(_arg, max_size=40))
def test_pack_evalsha_matches_redis_py(keys, argv):
    sha = "0123456789abcdef0123456789abcdef01234567"
    expected = b"".join(Connection().pack_command("EVALSHA", sha, len(keys), *keys, *argv))
    assert pack_evalsha(sha, keys, argv) == expected


@given(keys=st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=6),
       head=st.lists(_arg, max_size=4), shared=st.lists(_arg, max_size=12), tail=st.lists(_arg, max_size=3))
def test_an_argv_with_a_shared_run_packs_as_the_plain_list(keys, head, shared, tail):
    """An Argv's shared run is encoded once per run object and reused: the bytes stay redis-py's,
    for one call and for a pipeline, also when the run object is reused with other neighbours."""
    from region_agent.call import Argv
    from region_agent.store.scripts import pack_pipeline

    sha = "0123456789abcdef0123456789abcdef01234567"
    run = tuple(shared)
    argv = Argv([*head, *run, *tail], len(head), run)
    expected = b"".join(Connection().pack_command("EVALSHA", sha, len(keys), *keys, *head, *run, *tail))
    assert pack_evalsha(sha, keys, argv) == expected
    again = Argv([*tail, *run, *head], len(tail), run)  # the same run object, cached now
    expected2 = b"".join(Connection().pack_command("EVALSHA", sha, len(keys), *keys, *tail, *run, *head))
    assert pack_evalsha(sha, keys, again) == expected2
    assert pack_pipeline([(sha, keys, argv), (sha, keys, list(again))]) == expected + expected2

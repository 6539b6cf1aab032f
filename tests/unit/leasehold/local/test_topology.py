"""The local topology's state file (``<run-dir>/topology.json``): read once, checked there."""

from __future__ import annotations

from pathlib import Path

import pytest

from leasehold.local.topology import StateError, read_state


@pytest.mark.parametrize("text", [
    '{"serv',  # truncated
    "[]",
    '{"services": [{"kind": "agent"}]}',  # no pid, name, url: a KeyError in status / down / admit
    '{"services": [{"name": "x", "kind": "agent", "pid": -1, "url": "u"}]}',  # os.kill(-1) signals everything
    '{"services": [{"name": "x", "kind": "agent", "pid": 0, "url": "u"}]}',  # os.kill(0) signals the group
])
def test_a_file_of_another_shape_is_a_state_error(text: str, tmp_path: Path):
    (tmp_path / "topology.json").write_text(text)
    with pytest.raises(StateError, match="is not a topology state file"):
        read_state(tmp_path)


def test_no_file_is_no_topology_and_a_written_one_reads_back(tmp_path: Path):
    assert read_state(tmp_path) is None
    (tmp_path / "topology.json").write_text(
        '{"services": [{"name": "etcd-m0", "kind": "etcd", "pid": 4121, "url": "http://127.0.0.1:1", "log": "x"}],'
        ' "secrets": null}')
    assert read_state(tmp_path) == {"services": [{"name": "etcd-m0", "kind": "etcd", "pid": 4121,
                                                  "url": "http://127.0.0.1:1", "log": "x"}], "secrets": None}

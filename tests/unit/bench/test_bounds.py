"""What bounds a figure (bench.bounds.explain): figure 4's note names the CPU per grant of both
servers and, when the run recorded it, the grants an etcd transaction carried."""

from bench.bounds import explain
from bench.stats import Goal, Row


def _fig4(**more) -> Row:
    util = [{"allocator": 0.8, "etcd": 0.7, "machine": 1.99}] * 3
    extra = {"cpu_us_per_grant": [{"allocator": 70.0, "etcd": 60.0}] * 3, "cpu_utilisation": util,
             "ceiling_etcd_cpu_us_per_cas": [340.0] * 3, **more}
    return Row("4", "lease grants via /v1/leases/batch (64/batch)", 11_000.0, "grants/s", 2_900.0,
               "single CAS txn/s", Goal(">=", 4.0), extra=extra)


def test_figure_4_names_the_grants_per_transaction():
    (note,) = [n for n in explain([_fig4(grants_per_txn=[120.0, 231.0, 219.0])]) if n.startswith("Figure 4")]
    assert "allocator spends 70 us and etcd 60 us" in note
    assert "(etcd per single CAS: 340 us), 219 grants per etcd transaction." in note


def test_figure_4_of_a_run_without_the_count():
    (note,) = [n for n in explain([_fig4()]) if n.startswith("Figure 4")]
    assert "(etcd per single CAS: 340 us). " in note and "per etcd transaction" not in note

"""Values the launcher reads from the rendezvous store, written by something else (issue 31, point 7).

Each value is planted in a real store, as anything that reaches the port could: the launcher
ignores what is malformed with one warning line, and only a launcher's failure report stops a job.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dptrain.runtime import settings as _settings
from dptrain.runtime.heartbeat import keys_prefix
from dptrain.launcher import preflight, store_values
from dptrain.launcher.membership import Elastic, Membership
from dptrain.launcher.store import StoreClient
from dptrain.launcher.store_values import Warnings, clean, failure_text
from dptrain.launcher.watch import Watch, peer_failure
from tests.launcher.test_launch import dptrain_run
from tests.launcher.test_store import server  # noqa: F401 - the fixture: a store on a free port


@pytest.fixture
def client(server):
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    yield c
    c.close()


def _clean_lines(lines: list[str]) -> None:
    assert all("\x1b" not in line and "\n" not in line and "\r" not in line for line in lines), lines


def test_a_heartbeat_without_op_or_not_an_object_is_ignored_with_one_warning(client):
    client.set(f"{keys_prefix(0)}/hb/0", '{"seq":1,"ticks":0}')  # the audit's value: KeyError 'op' ended the job
    client.set(f"{keys_prefix(0)}/hb/1", "[1, 2]")
    client.set(f"{keys_prefix(0)}/hb/2", '{"seq":3,"ticks":1,"op":"all_reduce\\u001b[2J","ddp_steps":2}')
    lines: list[str] = []
    watch = Watch(client, 0, [], SimpleNamespace(received=False, forward=[]), lines.append, stall_s=0.0, nnodes=1)
    running = [SimpleNamespace(rank=r) for r in range(3)]
    seen: dict[int, list] = {}
    for _ in range(3):
        watch._report_stalls(seen, running)
    warned = [line for line in lines if "ignored a malformed heartbeat" in line]
    assert len(warned) == 2, lines  # once per key, however often it is read
    assert "'dptrain/attempt0/dp/hb/0'" in warned[0] and "no 'op'" in warned[0]
    assert "'dptrain/attempt0/dp/hb/1'" in warned[1] and "a JSON list, not an object" in warned[1]
    assert any("rank 2 has made no progress" in line and "waiting in all_reduce #3" in line for line in lines), lines
    _clean_lines(lines)  # the escape in rank 2's op was removed, not printed


def test_dptrain_run_goes_on_past_a_malformed_heartbeat(tmp_path):
    script = tmp_path / "plant.py"
    script.write_text(
        "import os, time\n"
        "from dptrain.launcher.store import StoreClient\n"
        "c = StoreClient(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']))\n"
        "c.set('dptrain/attempt0/dp/hb/0', '{\"seq\":1,\"ticks\":0}')\n"
        "time.sleep(2.5)  # the launcher reads heartbeats once a second\n"
        "print('still running')\n"
    )
    out = dptrain_run("--nproc-per-node", "1", str(script), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[rank0] still running" in out.stdout
    assert out.stderr.count("ignored a malformed heartbeat in the rendezvous store (key 'dptrain/attempt0/dp/hb/0')") \
        == 1, out.stderr
    assert "Traceback" not in out.stderr


def _node(client: StoreClient, node: int, lines: list[str], **kw) -> Elastic:
    kw = dict(dict(nproc=1, min_nodes=1, max_nodes=2, join_timeout=0.3, timeout=5.0), **kw)
    return Elastic(client, node, kw["nproc"], kw["min_nodes"], kw["max_nodes"], kw["join_timeout"], kw["timeout"],
                   lines.append, lambda: None)


def test_elastic_arrivals_that_are_not_json_a_list_or_without_node_are_ignored(client):
    for bad in ("not json", "[1, 2]", '{"nproc": 1, "token": "ab12"}'):
        number = client.add("launcher/elastic/0/arrivals", 1)
        client.set(f"launcher/elastic/0/arrival/{number}", bad)
    lines: list[str] = []
    assert _node(client, 0, lines).join(0) == Membership(node_rank=0, rank_base=0, num_nodes=1, world_size=1,
                                                         nodes=(0,))
    warned = [line for line in lines if "ignored a malformed elastic arrival" in line]
    assert len(warned) == 3, lines
    assert "not JSON" in warned[0] and "a JSON list" in warned[1] and "no 'node'" in warned[2]


def test_an_arrival_of_2_to_the_63_ranks_is_ignored_with_one_warning(client):
    # Issue 46, point 7: its nproc was taken (anything below 2**63), and node 0 then built a list of that many ranks.
    number = client.add("launcher/elastic/0/arrivals", 1)
    client.set(f"launcher/elastic/0/arrival/{number}", json.dumps({"node": 1, "nproc": 2**63 - 1, "token": "ab12"}))
    lines: list[str] = []
    assert _node(client, 0, lines).join(0) == Membership(node_rank=0, rank_base=0, num_nodes=1, world_size=1,
                                                         nodes=(0,))
    warned = [line for line in lines if "ignored a malformed elastic arrival" in line]
    assert len(warned) == 1 and "'nproc' is 9223372036854775807, not a whole number from 1 to 1398101" in warned[0]


def _arrival(**fields) -> bytes:
    return json.dumps({"node": 1, "nproc": 2, "token": "ab12", **fields}).encode()


@pytest.mark.parametrize("field, value, says", [
    ("nproc", 2**63, "'nproc' is 9223372036854775808, not a whole number from 1 to 1398101"),
    ("nproc", 2**62, "'nproc' is 4611686018427387904, not a whole number from 1 to 1398101"),
    ("nproc", 1398102, "'nproc' is 1398102, not a whole number from 1 to 1398101"),
    ("nproc", 0, "'nproc' is 0, not a whole number from 1 to 1398101"),
    ("node", 2**20, "'node' is 1048576, not a whole number from 0 to 1048575"),
    ("node", -1, "'node' is -1, not a whole number from 0 to 1048575"),
    ("node", True, "'node' is true, not a whole number"),
])
def test_the_counts_of_an_arrival_are_bounded_by_what_a_job_can_have(field, value, says):
    with pytest.raises(store_values.Malformed, match=f"^{re.escape(says)}"):
        store_values.arrival(_arrival(**{field: value}))


def test_every_count_a_value_carries_is_bounded():
    most = store_values.MAX_NPROC_PER_NODE
    assert store_values.arrival(_arrival(node=2**20 - 1, nproc=most)) == {"node": 2**20 - 1, "nproc": most,
                                                                          "token": "ab12"}
    nodes = [json.loads(_arrival(node=k, nproc=most)) for k in range(2)]  # each node's count in range, not the sum
    with pytest.raises(store_values.Malformed, match="2 nodes of 2796202 ranks in all, more than the 1048576"):
        store_values.members(json.dumps({"nodes": nodes}).encode())
    one = [json.loads(_arrival(node=0, nproc=2))]
    assert store_values.admission(json.dumps({"nodes": one, "generation": 10**9}).encode())["generation"] == 10**9
    for generation in (10**9 + 1, 2**63 - 1, 0):
        with pytest.raises(store_values.Malformed, match="'generation' is .*, not a whole number from 1 to 1000000000"):
            store_values.admission(json.dumps({"nodes": one, "generation": generation}).encode())
    beat = {"seq": 1, "ticks": 0, "op": ""}
    for field in ("seq", "ticks", "ddp_steps"):
        assert store_values.heartbeat(json.dumps({**beat, field: 2**53}).encode())[field] == 2**53
        with pytest.raises(store_values.Malformed, match=f"'{field}' is 9007199254740993, not a whole number from 0"):
            store_values.heartbeat(json.dumps({**beat, field: 2**53 + 1}).encode())
    with pytest.raises(store_values.Malformed, match="'ddp_steps' is 9223372036854775807"):
        store_values.left_note(b'{"ddp_steps": 9223372036854775807}')
    assert store_values.heartbeat(json.dumps({**beat, "pid": 2**40}).encode())["pid"] is None  # no process has it
    assert store_values.heartbeat(json.dumps({**beat, "pid": 4242}).encode())["pid"] == 4242


def test_dptrain_run_refuses_the_same_counts_for_its_own_job(monkeypatch):
    # The bounds are the launcher's own: a job it starts never has its values refused by its other nodes.
    assert store_values.MAX_NPROC_PER_NODE == store_values.PID_MAX_LIMIT // preflight.TASKS_PER_RANK
    assert store_values.MAX_GENERATION == _settings.SETTINGS["DPTRAIN_GENERATION"].high
    preflight.check_size(1024, 1024)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 2 --nnodes 524289: a job of 1048578 ranks is more than "
                                         r"the 1048576 dptrain runs \(node 0's store holds a connection for each\); "
                                         r"give fewer nodes or ranks per node$"):
        preflight.check_size(2, 2**19 + 1)
    # Where no limit of the machine can be read, the ceiling is still said.
    monkeypatch.setattr(preflight, "_task_room", lambda: [])
    monkeypatch.setattr(preflight, "_memory_room", lambda: [])
    monkeypatch.setattr(preflight, "raise_open_files_limit", lambda: 1 << 90)
    preflight.check_capacity(store_values.MAX_NPROC_PER_NODE)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 9223372036854775808: this machine cannot start "
                                         r"9223372036854775808 ranks: no machine can: Linux runs at most 4194304 "
                                         r"tasks \(the ceiling of pid_max\) and each rank takes 3; at most 1398101 "
                                         r"fit on this node$"):
        preflight.check_capacity(2**63)


def test_a_malformed_attempt_number_or_member_list_is_waited_past(client):
    client.set("launcher/elastic/current", "abc")
    lines: list[str] = []
    late = _node(client, 1, lines)
    found = {}
    t = threading.Thread(target=lambda: found.update(attempt=late.first_attempt()), daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # "abc" is not an attempt: it keeps waiting, as if nothing were there
    client.set("launcher/elastic/current", "0")
    t.join(10)
    assert found == {"attempt": 0}
    client.set("launcher/elastic/0/members", '{"nodes": "all"}')  # planted before node 0 decides
    t = threading.Thread(target=lambda: found.update(member=late.join(0)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not any("malformed list of an attempt's nodes" in line for line in lines):  # node 1 read it, waits on
        assert time.monotonic() < deadline and t.is_alive(), lines
        time.sleep(0.01)
    assert _node(client, 0, []).join(0).nodes == (0, 1)
    t.join(10)
    assert found["member"] == Membership(node_rank=1, rank_base=1, num_nodes=2, world_size=2, nodes=(0, 1))
    assert sum("malformed attempt number" in line for line in lines) == 1, lines


def test_only_a_well_formed_failure_report_stops_the_job(client, capfd):
    lines: list[str] = []
    warn = Warnings(lines.append)
    client.set("launcher/failed/0", b"on node 1: rank 3 \x1b[31mexited\x1b[0m\x1b[2J with code 1")
    client.set("launcher/failed/1", b"\xff\xfe not UTF-8")
    assert peer_failure(client, 0, warn) is None and peer_failure(client, 1, warn) is None
    assert peer_failure(client, 0, warn) is None and len(lines) == 2, lines  # said once per key
    assert "control characters" in lines[0] and "not UTF-8" in lines[1]
    _clean_lines(lines)
    report = failure_text(1, "rank 3 (local rank 1, pid 42) exited with code 1")
    client.set("launcher/failed/2", report)
    assert peer_failure(client, 2, warn) == "on node 1: rank 3 (local rank 1, pid 42) exited with code 1"
    client.close()
    assert peer_failure(client, 3, warn) == "the launcher of node 0 is unreachable"  # the store itself is gone


def test_warnings_are_single_clean_lines_at_most_a_few_per_kind():
    lines: list[str] = []
    warn = Warnings(lines.append, keys_per_kind=3)
    for i in range(50):
        warn("heartbeat", f"hb/{i}\x1b[2J", "bad\r\nvalue\x07")
        warn("heartbeat", f"hb/{i}\x1b[2J", "bad again")
    assert len(lines) == 4, lines
    assert lines[-1] == ("dptrain run: further malformed values in the rendezvous store (heartbeat) are ignored "
                         "without a warning")
    _clean_lines(lines)
    assert "\x07" not in lines[0] and "badvalue" in lines[0]
    assert clean("a\x1b[31mred\x1b[0m\u202etext\ttab") == "aredtexttab"

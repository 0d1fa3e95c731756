"""`kdcache train` over two nodes, tested on one: two torchrun agents on loopback (node ranks 0 and 1), one rank
each. One node is killed (its agent and its rank, kill -9) mid-run; the other stops, and both rerun resume to the
per-step losses of a straight run of the same world size."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.cli import user_env, user_project
from tests.helpers.s3server import free_port
from tests.train.common import losses, make_setup, run, train_cmd

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

STEPS = 10


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    return make_setup(tiny, tmp_path_factory)


def _args(setup, out):
    return train_cmd(setup, out, "--max-steps", STEPS, "--batch-size", 2, "--save-every", 2, "--threads", 1)[3:]


def _nodes(setup, out, port):
    """Two torchrun agents, node ranks 0 and 1, each in a session of its own (a machine of its own)."""
    env = user_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                              "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
                              "-m", "kdcache", *_args(setup, out)],
                             cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for n in (0, 1)]


def test_two_nodes_on_loopback_killed_on_one_node_resume_to_a_straight_runs_losses(setup, tmp_path):
    ref = tmp_path / "ref"                               # the same world size on one node: kdcache's launcher
    res = run([sys.executable, "-m", "kdcache", *_args(setup, ref), "--nproc-per-node", "2"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    want = [r["loss"] for r in losses(ref)]
    out = tmp_path / "o"
    nodes = _nodes(setup, out, free_port())
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and all(p.poll() is None for p in nodes):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.02)
    assert all(p.poll() is None for p in nodes), [p.communicate()[0][-2000:] for p in nodes]
    # Node 1 goes: its agent and its rank. torchrun starts each rank in a session of its own, so a kill of the
    # agent's process group alone would leave that rank training on (and node 0 waiting at the agents' exit barrier).
    import psutil
    for p in [psutil.Process(nodes[1].pid), *psutil.Process(nodes[1].pid).children(recursive=True)]:
        p.kill()
    nodes[1].communicate()
    try:
        first, _ = nodes[0].communicate(timeout=300)     # node 0's rank loses its peer and stops
    except subprocess.TimeoutExpired:
        os.killpg(nodes[0].pid, signal.SIGKILL)
        raise AssertionError("node 0 kept running after node 1 was killed") from None
    stopped_at = len(losses(out))
    assert nodes[0].returncode != 0 and 5 <= stopped_at < STEPS, (stopped_at, first[-3000:])
    assert (out / "checkpoints").is_dir() and any(d.startswith("step-") for d in os.listdir(out / "checkpoints"))
    again = _nodes(setup, out, free_port())
    outs = [p.communicate(timeout=400)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], [o[-3000:] for o in outs]
    assert "resumed from" in outs[0]
    got = losses(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == want              # bit-identical on CPU: no step lost or repeated

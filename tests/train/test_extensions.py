"""A build lock that a killed start left behind is cleared, not slept on; a live build's is waited for."""
import os
import threading
import time

from kdcache.train.extensions import build_guard


def _lock(root, age_s):
    d = root / "py311_cpu" / "deepspeed_shm_comm"
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.write_bytes(b"")
    old = time.time() - age_s
    for p in (d / "lock", d):
        os.utime(p, (old, old))
    return lock


def test_a_stale_build_lock_is_removed(tmp_path, capsys):
    lock = _lock(tmp_path, age_s=600)
    with build_guard(str(tmp_path), stale_s=120):
        assert not lock.exists()
    assert "removed" in capsys.readouterr().err


def test_a_live_build_is_waited_for_and_not_broken(tmp_path):
    lock = _lock(tmp_path, age_s=0)

    def finish_build():
        time.sleep(0.6)
        (lock.parent / "shm.o").write_bytes(b"x")          # a build writes as it goes ...
        time.sleep(0.6)
        lock.unlink()                                      # ... and removes its lock when done
    t = threading.Thread(target=finish_build)
    t.start()
    start = time.time()
    with build_guard(str(tmp_path), stale_s=1.0, poll_s=0.05):
        waited = time.time() - start
    t.join()
    assert waited >= 1.1 and not lock.exists()


def test_a_second_guard_waits_for_the_first(tmp_path):
    order = []
    with build_guard(str(tmp_path)):
        def second():
            with build_guard(str(tmp_path)):
                order.append("second")
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first done")
    t.join(5)
    assert order == ["first done", "second"]


def test_deepspeed_skips_its_cpu_comm_op_once_marked():
    """The op is DeepSpeed's to build unless marked: marked, init_distributed's build_shm_op neither builds nor
    loads it (tests/train/test_trainer.py checks that a whole run builds nothing)."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    from kdcache.train.extensions import skip_cpu_comm_op
    assert deepspeed.ops.__compatible_ops__.get(ShareMemCommBuilder.NAME)     # on Linux: it would be built
    assert skip_cpu_comm_op()
    assert build_shm_op() is None


def test_a_stale_lock_under_torch_extensions_dir_is_removed(tmp_path):
    """$TORCH_EXTENSIONS_DIR holds each op's directory directly, without the py311_cpu level."""
    d = tmp_path / "cpu_adam"
    d.mkdir()
    lock = d / "lock"
    lock.write_bytes(b"")
    old = time.time() - 600
    for p in (lock, d):
        os.utime(p, (old, old))
    with build_guard(str(tmp_path), stale_s=120):
        assert not lock.exists()

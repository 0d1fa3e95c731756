"""Load: readers of one cache, and readers polling a cache that is being written, all at once."""
import multiprocessing as mp
import os

import pytest

from kdcache.cache_format import ManifestMissing, open_cache, write_cache
from tests.helpers.records import make_records, writer_kwargs


def _stream_all(path, epochs, q):
    try:
        from kdcache.train.data import CacheStream
        s = CacheStream(path, seed=os.getpid(), epochs=epochs)
        q.put(("reader", sorted(r.sample_id for r, _ in s.samples())))
    except BaseException as e:  # report, do not hang the parent
        q.put(("error", repr(e)))


def _poll_growing(path, q, timeout=300):
    """Open the cache being written over and over until it is complete; every listed shard must decode whole."""
    import time
    seen, problems, t0 = 0, [], time.time()
    while time.time() - t0 < timeout:
        try:
            cache = open_cache(path)
        except ManifestMissing:     # before the first manifest exists
            time.sleep(0.05)
            continue
        except Exception as e:      # a torn or half-written manifest: what this test exists to catch
            problems.append(("open", f"{type(e).__name__}: {e}"))
            time.sleep(0.05)
            continue
        for j in range(cache.num_shards):
            n = sum(1 for _ in cache.iter_shard(j))
            if n != cache.shards[j].num_samples:
                problems.append((cache.shards[j].path, n))
        seen = max(seen, cache.num_shards)
        if cache.complete:
            break
        time.sleep(0.2)             # poll, do not spin: the writer shares the two cores
    q.put(("poller", seen, problems))


@pytest.mark.slow
@pytest.mark.ray
def test_concurrent_readers_while_a_precompute_writes(tmp_path, tiny):
    """Three training readers stream cache A twice; meanwhile `kdcache precompute` writes cache B in the
    same store and two more processes keep reopening B and decoding every shard it lists."""
    from tests.helpers.cli import precompute, write_jsonl
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, make_records(120, seed=1), shard_size=10, **writer_kwargs("arrow"))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_stream_all, args=(str(a), 2, q)) for _ in range(3)]
    procs += [ctx.Process(target=_poll_growing, args=(str(b), q)) for _ in range(2)]
    for p in procs:
        p.start()
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:40])
    results = []
    try:
        res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", b, "--backend", "hf", "--top-k", 8,
                         "--shard-size", 2, "--format", "zarr", shared_ray=True)      # 20 commits meanwhile
        # a failed job first, with its own output (the pollers would wait out their timeout for it)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        results = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60 if len(results) == len(procs) else 0)
            if p.is_alive():
                p.kill()
    assert not [r for r in results if r[0] == "error"], results
    readers = [r[1] for r in results if r[0] == "reader"]
    assert len(readers) == 3 and all(r == sorted(list(range(120)) * 2) for r in readers)
    pollers = [r for r in results if r[0] == "poller"]
    assert len(pollers) == 2 and all(not r[2] for r in pollers)        # never a partial shard
    assert all(r[1] == 20 for r in pollers)                            # they followed it to the end
    assert open_cache(b).complete and len(open_cache(b)) == 40

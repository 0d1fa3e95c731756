"""Encoded samples spooled to disk: tokenize once in the scan, stream them to the workers later.

An Arrow IPC stream of (sample_id, input_ids, positions, truncated) in dataset order, in a
directory kdcache-spool-<pid namespace>-<pid>-* under $KDCACHE_SPOOL_DIR or the system temp directory (set TMPDIR
or KDCACHE_SPOOL_DIR to a large disk for big datasets), deleted when the job ends; one left by a
killed job is deleted by the next job on the machine. Kept out of the cache itself, so nothing in
the cache changes before the job holds the writer lock. Keeps the driver's memory flat and its
CPU free while the teacher runs.
"""
import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa

from cache_format.lease import process_dir

from .encode import Sample

SCHEMA = pa.schema([("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                    ("positions", pa.list_(pa.int32())), ("truncated", pa.bool_())])
BATCH = 1024


PREFIX = "kdcache-spool-"


class Spool:
    def __init__(self, parent=None):
        parent = parent or os.environ.get("KDCACHE_SPOOL_DIR") or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.dir = process_dir(parent, PREFIX)
        self.path = os.path.join(self.dir, "encoded.arrow")
        self._sink = pa.OSFile(self.path, "wb")
        self._writer = pa.ipc.new_stream(self._sink, SCHEMA)
        self._rows = []

    def add(self, sample: Sample):
        self._rows.append(sample)
        if len(self._rows) >= BATCH:
            self._flush()

    def _flush(self):
        if self._rows:
            rows = self._rows
            self._writer.write_batch(pa.record_batch([
                pa.array([s.sample_id for s in rows], pa.int64()),
                pa.array([s.input_ids for s in rows], pa.list_(pa.int32())),
                pa.array([s.positions for s in rows], pa.list_(pa.int32())),
                pa.array([s.truncated for s in rows], pa.bool_())], schema=SCHEMA))
            self._rows = []

    def close_writing(self):
        self._flush()
        self._writer.close()
        self._sink.close()

    def __iter__(self):
        """The Samples in the order added (int32 arrays, as spooled)."""
        with pa.memory_map(self.path) as src:
            for batch in pa.ipc.open_stream(src):
                sid, trunc = batch.column(0).to_pylist(), batch.column(3).to_pylist()
                ids, pos = _rows(batch.column(1)), _rows(batch.column(2))
                for r in range(batch.num_rows):
                    yield Sample(sid[r], ids[r], pos[r], trunc[r])

    def delete(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _rows(col):
    """Every row of a list<int32> column as an int32 array: one conversion per batch, not per row (a copy: the
    memory map closes after iteration)."""
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=True)
    return [values[offsets[r]:offsets[r + 1]] for r in range(len(col))]

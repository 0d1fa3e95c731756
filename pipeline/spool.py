"""Encoded samples spooled to disk: tokenize once in the scan, stream them to the workers as it goes.

Segments of (sample_id, input_ids, positions, truncated, teacher view) in dataset order, each a self-contained Arrow IPC
stream appended to one file, in a directory kdcache-spool-<pid namespace>-<pid>-* under $KDCACHE_SPOOL_DIR or
the system temp directory (set TMPDIR or KDCACHE_SPOOL_DIR to a large disk for big datasets), deleted when the
job ends; one left by a killed job is deleted by the next job on the machine. A segment is readable as soon as
it is written (flush), so the workers get a shard's samples while the scan is still reading later records.
Kept out of the cache itself, so nothing in the cache changes before the job holds the writer lock. Keeps the
driver's memory flat and its CPU free while the teacher runs.
"""
import errno
import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa

from kdcache.cache_format.lease import process_dir
from kdcache.common.atomic import crash_point
from kdcache.common.errors import DataError

from .encode import Sample

SCHEMA = pa.schema([("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                    ("positions", pa.list_(pa.int32())), ("truncated", pa.bool_()),
                    ("teacher_ids", pa.list_(pa.int32())), ("teacher_positions", pa.list_(pa.int32()))])
# the last two are null where the record has no teacher view (privileged context)
BATCH = 1024


PREFIX = "kdcache-spool-"


class Spool:
    def __init__(self, parent=None):
        parent = parent or os.environ.get("KDCACHE_SPOOL_DIR") or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.dir = process_dir(parent, PREFIX)
        self.path = os.path.join(self.dir, "encoded.arrow")
        self._file = open(self.path, "wb")
        self.segments = []           # (offset, bytes) of every readable segment, in order
        self._rows = []

    def add(self, sample: Sample):
        self._rows.append(sample)
        if len(self._rows) >= BATCH:
            self.flush()

    def flush(self):
        """Make every sample added so far readable: one more segment."""
        if not self._rows:
            return
        rows = self._rows
        batch = pa.record_batch([
            pa.array([s.sample_id for s in rows], pa.int64()),
            pa.array([s.input_ids for s in rows], pa.list_(pa.int32())),
            pa.array([s.positions for s in rows], pa.list_(pa.int32())),
            pa.array([s.truncated for s in rows], pa.bool_()),
            pa.array([s.teacher_ids for s in rows], pa.list_(pa.int32())),
            pa.array([s.teacher_positions for s in rows], pa.list_(pa.int32()))], schema=SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, SCHEMA) as w:
            w.write_batch(batch)
        buf = sink.getvalue()
        offset = self._file.tell()
        try:
            crash_point("spool-write")
            self._file.write(buf)
            self._file.flush()
        except OSError as e:
            raise DataError(self._write_failure(e)) from None
        self.segments.append((offset, buf.size))
        self._rows = []

    def _write_failure(self, error):
        """What to say when the spool cannot be written: where, whether the disk is full, where to move it."""
        try:
            free = f"{shutil.disk_usage(self.dir).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        what = f"disk full ({free})" if error.errno == errno.ENOSPC else f"{error.strerror or error}"
        return (f"spool {self.path}: writing the tokenized samples failed: {what}. Nothing was committed to the "
                "cache by this failure; set KDCACHE_SPOOL_DIR (or TMPDIR) to a directory on a larger disk, then "
                "rerun the same command")

    def close_writing(self):
        self.flush()
        self._file.close()

    def reader(self):
        return SpoolReader(self)

    def __iter__(self):
        """The Samples in the order added (int32 arrays, as spooled)."""
        yield from self.reader().take()

    def delete(self):
        if not self._file.closed:
            self._file.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SpoolReader:
    """The spooled samples in order, each once, as far as the segments written so far reach."""

    def __init__(self, spool):
        self.spool = spool
        self._next = 0               # the next segment to read
        self._buf, self._pos = [], 0

    def take(self, end=None):
        """The samples not taken yet whose sample_id < end (every readable one if end is None), in order."""
        out = []
        while True:
            while self._pos < len(self._buf):
                s = self._buf[self._pos]
                if end is not None and s.sample_id >= end:
                    return out
                out.append(s)
                self._pos += 1
            if not self._load():
                return out

    def _load(self):
        if self._next >= len(self.spool.segments):
            return False
        offset, size = self.spool.segments[self._next]
        self._next += 1
        with open(self.spool.path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        batch = pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
        sid, trunc = batch.column(0).to_pylist(), batch.column(3).to_pylist()
        ids, pos = _rows(batch.column(1)), _rows(batch.column(2))
        t_ids, t_pos = _rows(batch.column(4)), _rows(batch.column(5))
        view = np.asarray(batch.column(4).is_valid().to_numpy(zero_copy_only=False), bool)
        self._buf = [Sample(sid[r], ids[r], pos[r], trunc[r], *((t_ids[r], t_pos[r]) if view[r] else ()))
                     for r in range(batch.num_rows)]
        self._pos = 0
        return True


def _rows(col):
    """Every row of a list<int32> column as an int32 array: one conversion per batch, not per row (a copy, so
    the batch's buffer can go)."""
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=True)
    return [values[offsets[r]:offsets[r + 1]] for r in range(len(col))]

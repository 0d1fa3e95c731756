"""Where a cache lives: a local directory, or an fsspec URL (s3://, gs://, memory://, ...).

Local directories keep the POSIX path: temp file + fsync + rename, flock. URLs go through
fsspec. Object stores have no rename, but an object appears whole or not at all, so one PUT
is atomic by itself: a shard is uploaded under its final name and becomes visible to readers
only when the manifest, written last, lists it. Where the store offers conditional puts (S3:
If-None-Match / If-Match), the lock is created exclusively and the manifest is only replaced
if nobody else replaced it since this writer last wrote it.
"""
import hashlib
import json
import os
import shutil
import tempfile
import uuid

from kdcache.common.atomic import atomic_write_bytes, crash_point, remove

from .errors import CacheError, ConflictError

NO_SUCH_ETAG = '"' + "0" * 32 + '"'     # an MD5-shaped ETag no object has: If-Match on it must fail


def is_url(path) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


class Location:
    """A directory-like place: `Location("runs/cache")` or `Location("s3://bucket/store/x")`."""

    def __init__(self, where, storage_options=None):
        where = str(where)
        if where.startswith("file://"):
            where = where[len("file://"):]
        self.url = where.rstrip("/") if is_url(where) else os.path.abspath(where)
        self.remote = is_url(where)
        self.storage_options = storage_options or {}
        self._fs = None
        self._conditional_checked = False

    def __repr__(self):
        return f"Location({self.url!r})"

    def __str__(self):
        return self.url

    @property
    def fs(self):
        if self._fs is None:
            import fsspec
            opts = dict(self.storage_options)
            if self.protocol in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
                opts.setdefault("use_listings_cache", False)   # other processes write here: always ask the store
            try:
                self._fs, _ = fsspec.core.url_to_fs(self.url, **opts)
            except (ImportError, ValueError) as e:     # gs:// without gcsfs, an unknown scheme
                raise CacheError(f"{self.url}: {e}") from e
        return self._fs

    @property
    def protocol(self):
        return self.url.split("://", 1)[0] if self.remote else "file"

    def path(self, rel=""):
        """Full path (local) or URL (remote) of rel, a '/'-separated path inside this location."""
        if not rel:
            return self.url
        return f"{self.url}/{rel}" if self.remote else os.path.join(self.url, *rel.split("/"))

    def child(self, rel):
        loc = Location(self.path(rel), self.storage_options)
        loc._fs, loc._conditional_checked = self._fs, self._conditional_checked
        return loc

    # -- small objects ---------------------------------------------------------------
    def exists(self, rel=""):
        return self.fs.exists(self.path(rel)) if self.remote else os.path.lexists(self.path(rel))

    def read_bytes(self, rel):
        """The object's bytes; FileNotFoundError if absent."""
        if self.remote:
            return self.fs.cat_file(self.path(rel))
        with open(self.path(rel), "rb") as f:
            return f.read()

    def read_json(self, rel):
        return json.loads(self.read_bytes(rel).decode("utf-8"))

    @property
    def conditional(self):
        """Whether the store itself enforces conditional puts (S3 If-None-Match / If-Match)."""
        return self.protocol in ("s3", "s3a")

    def check_conditional(self):
        """CacheError unless a store that claims conditional puts really enforces them (checked once).

        s3fs drops keyword arguments the installed botocore does not know, so with an old pair
        If-None-Match / If-Match vanish silently and every "conditional" write replaces what is there.
        A probe object under a random dot-name (ignored by readers) is created exclusively, then written
        again once exclusively and once with a wrong If-Match: both must fail. Stores without conditional
        puts (memory://, gs://) keep their read-then-write checks and are not probed.
        """
        if not self.conditional or self._conditional_checked:
            return
        probe = f".kdcache-probe-{uuid.uuid4().hex[:16]}"
        ignored = []
        try:
            self.write_bytes(probe, b"probe\n", exclusive=True)
            for header, cond in (("If-None-Match", {"exclusive": True}), ("If-Match", {"if_match": NO_SUCH_ETAG})):
                try:
                    self.write_bytes(probe, b"must not land\n", **cond)
                    ignored.append(header)
                except ConflictError:
                    pass
                except OSError as e:       # e.g. 501 NotImplemented: a store that knows no conditions at all
                    raise CacheError(f"{self.url}: the object store refused a write with {header} ({e}); kdcache "
                                     "needs conditional writes to lock and commit a cache on it") from e
        finally:
            self.remove(probe)
        if ignored:
            raise CacheError(
                f"{self.url}: the object store accepted writes that should have failed their "
                f"{' and '.join(ignored)} condition, so the writer lock and manifest commits would not be safe. "
                f"Most likely botocore is too old for these conditions and s3fs silently dropped them "
                f"({_versions()}): upgrade s3fs and botocore (pip install -U s3fs botocore), or write the cache "
                "to a local directory.")
        self._conditional_checked = True

    def etag(self, rel):
        """Version tag of a remote object: S3's ETag, elsewhere the sha256 of its bytes. None if absent or local."""
        if not self.remote:
            return None
        try:
            if self.conditional:
                return self.fs.info(self.path(rel)).get("ETag")
            return hashlib.sha256(self.read_bytes(rel)).hexdigest()
        except FileNotFoundError:
            return None

    def write_bytes(self, rel, data: bytes, *, exclusive=False, if_match=None):
        """Write an object whole. exclusive: fail if it exists; if_match: only replace that version.

        Returns the new version tag (see etag; None locally). Raises ConflictError when a condition
        fails. Locally the write is temp + fsync + rename (conditions are for object stores; local
        writers are serialised by flock). On stores without conditional puts the conditions are
        checked by reading first, which narrows but does not close the race (S3 closes it).
        """
        if not self.remote:
            path = self.path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if exclusive:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError as e:
                    raise ConflictError(f"{path} exists") from e
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                atomic_write_bytes(path, data)
            return None
        return self._put(rel, data, exclusive, if_match)

    def _put(self, rel, data, exclusive, if_match):
        crash_point("before-replace-" + rel.rsplit("/", 1)[-1])
        path = self.path(rel)
        kwargs = {}
        if self.conditional:
            if if_match:
                kwargs["IfMatch"] = if_match
            if exclusive:
                kwargs["mode"] = "create"
        elif exclusive or if_match:          # no conditional puts here: check by reading first
            current = self.etag(rel)
            if exclusive and current is not None:
                raise ConflictError(f"{path} exists")
            if if_match and current != if_match:
                raise ConflictError(f"{path} changed or vanished since it was last written")
        try:
            out = self.fs.pipe_file(path, data, **kwargs)
        except FileExistsError as e:
            raise ConflictError(f"{path} exists") from e
        except FileNotFoundError as e:     # S3 If-Match on a key that is gone
            if if_match:
                raise ConflictError(f"{path} vanished since it was last written") from e
            raise
        except OSError as e:
            if "precondition" in str(e).lower() or (getattr(e, "errno", None) == 22 and if_match):
                raise ConflictError(f"{path} changed since it was last written ({e})") from e
            raise
        self.fs.invalidate_cache(path)
        if self.conditional:
            return out.get("ETag") if isinstance(out, dict) else self.etag(rel)
        return hashlib.sha256(data).hexdigest()

    def write_json(self, rel, obj, **kw):
        return self.write_bytes(rel, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"), **kw)

    def list(self, rel=""):
        """Names of the immediate children of rel ([] if it does not exist)."""
        if not self.remote:
            d = self.path(rel)
            return sorted(os.listdir(d)) if os.path.isdir(d) else []
        try:
            entries = self.fs.ls(self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def newest_mtime(self, rel=""):
        """Latest modification time (unix seconds) of anything under rel; None if it holds nothing."""
        if not self.remote:
            times = [os.stat(os.path.join(d, f)).st_mtime for d, _, fs in os.walk(self.path(rel)) for f in fs]
        else:
            found = self.fs.find(self.path(rel), detail=True)
            times = []
            for i in found.values():
                m = i.get("LastModified") or i.get("mtime") or i.get("created")
                if m is not None:
                    times.append(m.timestamp() if hasattr(m, "timestamp") else float(m))
        return max(times) if times else None

    def remove(self, rel=""):
        """Delete a file or a whole directory/prefix; absent is fine."""
        if not self.remote:
            remove(self.path(rel))
            return
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path(rel))

    # -- shard transfer --------------------------------------------------------------
    def upload(self, local_path, rel):
        """Copy a finished local file or directory to rel (remote only). Each object lands whole."""
        crash_point("before-upload")
        target = self.path(rel)
        if os.path.isdir(local_path):
            self.remove(rel)
            for d, _, files in os.walk(local_path):
                for f in sorted(files):
                    src = os.path.join(d, f)
                    sub = os.path.relpath(src, local_path).replace(os.sep, "/")
                    self.fs.put_file(src, f"{target}/{sub}")
        else:
            self.fs.put_file(local_path, target)
        self.fs.invalidate_cache(target)

    def download(self, rel, local_path):
        """Copy rel (file or directory) to local_path, written beside it then renamed into place."""
        src = self.path(rel)
        parent = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".download-", dir=parent)
        try:
            out = os.path.join(tmp, "x")
            if self.fs.isdir(src):
                for path in self.fs.find(src):
                    sub = path[len(self.fs._strip_protocol(src)):].lstrip("/")
                    os.makedirs(os.path.dirname(os.path.join(out, sub)), exist_ok=True)
                    self.fs.get_file(path, os.path.join(out, sub))
            else:
                self.fs.get_file(src, out)
            remove(local_path)
            os.replace(out, local_path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _versions():
    """'s3fs X, botocore Y' as installed, for error messages."""
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for name in ("s3fs", "botocore"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join(out)


def as_location(where):
    return where if isinstance(where, Location) else Location(where)

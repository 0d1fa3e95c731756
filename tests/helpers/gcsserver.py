"""A GCS-compatible server (gcp-storage-emulator, from PyPI) on 127.0.0.1, in its own process.

gcsfs reaches it through STORAGE_EMULATOR_HOST with anonymous credentials, like a real bucket over the JSON API;
child processes (Ray workers) inherit the variables. gcsfs's experimental zonal/HNS bucket probe speaks gRPC,
which the emulator lacks: GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false keeps gcsfs on its JSON API, as on a standard
bucket.

One bug of the emulator is mended here: it parses a multipart upload with Python's email parser, which takes a
carriage return at the end of the content for part of the line break before the boundary, so a file ending in
b"\\r" lost its last byte (kdcache's `verify` caught it on a Zarr shard: 59 bytes stored of 60). The mended parser
takes exactly the one line break before the boundary, as GCS does.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request


class GCSServer:
    def __init__(self):
        from tests.helpers.s3server import free_port  # here: run as a script (below), tests is not importable
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout=60):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2)
                return self
            except OSError:
                if self.proc.poll() is not None or time.time() - t0 > timeout:
                    raise RuntimeError(f"the GCS emulator did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def env(self):
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "GOOGLE_CLOUD_PROJECT": "kdcache-test"}

    def make_bucket(self, name):
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=kdcache-test",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10)
        return f"gs://{name}"

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


def _mended_read_data(server):
    original = server._read_data

    def read_data(handler, query):
        ctype = handler.headers.get("Content-Type") or ""
        if not ctype.startswith("multipart/related"):
            return original(handler, query)
        raw = server._decode_raw_data(server._read_raw_data(handler), handler)
        delim = b"--" + ctype.split("boundary=", 1)[1].strip('"').encode()
        crlf = raw.startswith(delim + b"\r\n")
        eol = b"\r\n" if crlf else b"\n"
        parts = raw.split(eol + delim)                    # each boundary line starts with a line break
        meta_part, content_part = parts[0], parts[1]
        meta = meta_part.split(eol + eol, 1)[1]
        head, content = content_part.split(eol + eol, 1)
        ctype_of = next((h.split(b":", 1)[1].strip().decode() for h in head.split(eol)
                         if h.lower().startswith(b"content-type:")), "application/octet-stream")
        return {"meta": json.loads(meta), "content": content, "content-type": ctype_of}

    server._read_data = read_data


if __name__ == "__main__":
    from gcp_storage_emulator import server as emulator
    _mended_read_data(emulator)
    emulator.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).start()
    while True:
        time.sleep(3600)

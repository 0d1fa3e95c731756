"""A real S3-compatible server (moto's, from PyPI) on 127.0.0.1, in its own process.

Clients reach it over HTTP like any S3 endpoint: s3fs/botocore read AWS_ENDPOINT_URL and the
credentials from the environment, which child processes (Ray workers, trainers) inherit.
"""
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout=60):
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.time() - t0 > timeout:
                    raise RuntimeError(f"the moto S3 server did not start on {self.endpoint}") from None
                time.sleep(0.1)
        return self

    def env(self):
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self, name):
        import fsspec
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(name)
        return f"s3://{name}"

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


def upload_dir(local_dir, url):
    """Copy a local directory tree to an s3:// URL, file by file."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(url)
    for d, _, files in os.walk(local_dir):
        for f in files:
            src = os.path.join(d, f)
            fs.put_file(src, root + "/" + os.path.relpath(src, local_dir).replace(os.sep, "/"))
    return url

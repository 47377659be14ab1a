"""A real S3 server on loopback for the object-store benchmarks and tests: moto's standalone
server (``moto_server``), started on a free port and stopped after, and the environment a
client needs to reach it (``AWS_ENDPOINT_URL`` and dummy credentials, as any S3-compatible
store is reached)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

# What every S3 client reads from the standard environment to reach moto.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "x",
    "AWS_SECRET_ACCESS_KEY": "x",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def moto_server(timeout: float = 30.0) -> Iterator[str]:
    """Run ``moto_server`` on a free loopback port for the block; yields its endpoint URL.
    The server is stopped (and waited for) however the block ends."""
    port = free_port()
    command = [shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server on port {port} did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """Point the standard S3 environment at ``endpoint`` for the block, then restore it."""
    wanted = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

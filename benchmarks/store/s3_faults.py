"""A flaky object store: an HTTP proxy in front of a real S3 server that injects the faults
stores under load give, and the loader's samples/s through it with and without them.

    python -m benchmarks.store.s3_faults [--batches 300] [--workers 4] [--rounds 2]
    python -m benchmarks.store.s3_faults serve UPSTREAM PORT [--slowdown 0.2] [--short 0.05] [--reset 0.01]

The proxy (``serve``, or :func:`fault_proxy` from a test) forwards every request to UPSTREAM
and, drawn per request from a seeded generator, answers ``--slowdown`` of them with ``503
SlowDown`` (never forwarded), cuts ``--short`` of the GET bodies short (the full
``Content-Length`` promised, half the body sent, the connection closed) and resets
``--reset`` of the connections (``SO_LINGER`` 0, no answer). It runs in its own process, so
that the loader's forked workers never inherit its threads.

The benchmark builds the sample corpus (``examples/wavs``) into a cache, pushes it to a local
moto server, and streams it with ``make_loader`` through the proxy without faults and with
the issue's faults (20 % SlowDown, 5 % short bodies, 1 % resets), alternating, ``--rounds``
times each (the best counts); the batches of both are compared. One JSON line per row, then
the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common.s3_server import free_port, moto_server, s3_environment

SLOWDOWN = b"""<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"""
ISSUE_FAULTS = {"slowdown": 0.20, "short": 0.05, "reset": 0.01}
NO_FAULTS = {"slowdown": 0.0, "short": 0.0, "reset": 0.0}


def make_handler(upstream: str, faults: dict[str, float], seed: int) -> type:
    """A request handler class forwarding to ``upstream`` (``host:port``) with ``faults``."""
    draw, lock = random.Random(seed), threading.Lock()

    class Flaky(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients use stores
        disable_nagle_algorithm = True  # else headers and body wait out the delayed ACK (40 ms)

        def log_message(self, *_: object) -> None:  # one line per request would drown the rest
            pass

        def _forward(self) -> None:
            with lock:
                roll = draw.random()
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if roll < faults["reset"]:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )  # close now sends RST: the client sees "connection reset by peer"
                self.close_connection = True
                return
            if roll < faults["reset"] + faults["slowdown"]:
                self._answer(503, {"Content-Type": "application/xml"}, SLOWDOWN)
                return
            status, headers, payload = _upstream(
                upstream, self.command, self.path, self.headers, body
            )
            cut = roll < faults["reset"] + faults["slowdown"] + faults["short"]
            if cut and self.command == "GET" and len(payload) > 1:
                self._answer(status, headers, payload, send=len(payload) // 2)
                self.close_connection = True
                return
            self._answer(status, headers, payload)

        def _answer(self, status: int, headers: dict[str, str], payload: bytes,
                    send: int | None = None) -> None:  # fmt: skip
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload[:send])

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Flaky


def _upstream(
    upstream: str, method: str, path: str, headers: object, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One request to the real server: status, headers (less the hop-by-hop ones), body."""
    connection = http.client.HTTPConnection(upstream, timeout=60)
    try:
        connection.request(method, path, body=body, headers=dict(headers.items()))  # type: ignore[attr-defined]
        response = connection.getresponse()
        payload = response.read()
        skip = {"content-length", "connection", "transfer-encoding", "keep-alive"}
        kept = {k: v for k, v in response.getheaders() if k.lower() not in skip}
        return response.status, kept, payload
    finally:
        connection.close()


@contextlib.contextmanager
def fault_proxy(upstream_url: str, faults: dict[str, float], seed: int = 0) -> Iterator[str]:
    """Run the proxy in front of ``upstream_url`` in a process of its own for the block;
    yields its URL (what ``AWS_ENDPOINT_URL`` then names)."""
    port = free_port()
    rates = [f"--{name}={rate}" for name, rate in faults.items()]
    command = [sys.executable, "-m", "benchmarks.store.s3_faults", "serve",
               upstream_url.removeprefix("http://"), str(port), f"--seed={seed}", *rates]  # fmt: skip
    proxy = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fault proxy did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)


def serve(argv: list[str]) -> None:
    """``serve UPSTREAM PORT [--slowdown R] [--short R] [--reset R] [--seed N]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store.s3_faults serve")
    parser.add_argument("upstream")
    parser.add_argument("port", type=int)
    for name in NO_FAULTS:
        parser.add_argument(f"--{name}", type=float, default=ISSUE_FAULTS[name])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    faults = {name: getattr(args, name) for name in NO_FAULTS}
    handler = make_handler(args.upstream, faults, args.seed)
    http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler).serve_forever()


def samples_per_second(cache: str, batches: int, workers: int) -> tuple[float, list[list[str]]]:
    """The loader's samples/s over ``batches`` batches of ``cache``, warm (its first batch
    not counted), and every batch's keys."""
    from melcache.loader import DataConfig, make_loader

    data = DataConfig(batch_frames=3000, max_batch_size=4, num_workers=workers)
    loader = make_loader(cache, data, seed=5)
    stream = iter(loader)
    keys = [next(stream).keys]
    began = time.perf_counter()
    for _ in range(batches - 1):
        keys.append(next(stream).keys)
    seconds = time.perf_counter() - began
    loader.close()
    return sum(len(k) for k in keys[1:]) / seconds, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as folder, moto_server() as endpoint:
        cache = Path(folder, "cache")
        config = Path(folder, "small.toml")
        config.write_text("[build]\nnum_buckets = 4\nmin_shards = 8\n")
        run = [sys.executable, "-m", "preprocess"]
        subprocess.run([*run, "build", "--src", str(repo / "examples/wavs"), "--out", str(cache),
                        "--config", str(config), "--workers", "2"], check=True,
                       capture_output=True, cwd=repo)  # fmt: skip
        with s3_environment(endpoint):
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench")
            subprocess.run([*run, "push", str(cache), "s3://bench/cache"], check=True,
                           capture_output=True, cwd=repo)  # fmt: skip
        best = {"no faults": 0.0, "faults": 0.0}
        seen: dict[str, list[list[str]]] = {}
        for _ in range(args.rounds):
            for row, faults in (("no faults", NO_FAULTS), ("faults", ISSUE_FAULTS)):
                with fault_proxy(endpoint, faults) as proxy, s3_environment(proxy):
                    rate, keys = samples_per_second("s3://bench/cache", args.batches, args.workers)
                best[row] = max(best[row], rate)
                seen[row] = keys
    same = seen["faults"] == seen["no faults"]
    for row, rate in best.items():
        print(json.dumps({"row": f"loader through the proxy, {row}", "batches": args.batches,
                          "workers": args.workers, "samples_per_s": round(rate, 1)}))  # fmt: skip
    ratio = best["faults"] / best["no faults"]
    print(json.dumps({"row": "ratio", "faults_over_no_faults": round(ratio, 3),
                      "same_batches": same}))  # fmt: skip


if __name__ == "__main__":
    serve(sys.argv[2:]) if sys.argv[1:2] == ["serve"] else main()

"""S3 clients side by side on many concurrent ranged reads: obstore, boto3 and s3fs.

    python -m benchmarks.store.s3_clients [--objects 8] [--mb 2] [--reads 800] [--kib 64]
                                    [--concurrency 16] [--rounds 3]

Starts a local moto server (``benchmarks/common/s3_server.py``), puts ``--objects`` random objects
of ``--mb`` MB in it, then has each client read ``--reads`` random ranges of ``--kib`` KiB
(what ``melcache.open(...)[key]`` and a shard's chunked read issue), ``--concurrency`` at a
time in a thread pool (each client called as a user calls it: boto3 and obstore from
threads, s3fs through its own async ``cat_ranges``). Clients alternate, ``--rounds`` times
each; the best round counts. Every read's bytes are compared with the object's. One JSON line
per client, then one of ratios to boto3.

moto is a Python server, so on a small machine the server is most of the cost: the ratios
are what each client adds on top, not what a cloud store would give.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import time
from collections.abc import Callable

from benchmarks.common.s3_server import moto_server, s3_environment

BUCKET = "bench"
Read = Callable[[list[tuple[str, int, int]]], list[bytes]]  # (key, start, stop) → bytes


def boto3_reader(concurrency: int) -> Read:
    """boto3 ``get_object`` with a ``Range`` header, from a thread pool (one client)."""
    import boto3
    import botocore.config

    config = botocore.config.Config(max_pool_connections=concurrency)
    client = boto3.client("s3", config=config)

    def one(item: tuple[str, int, int]) -> bytes:
        key, start, stop = item
        answer = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{stop - 1}")
        return answer["Body"].read()

    return _pooled(one, concurrency)


def obstore_reader(concurrency: int) -> Read:
    """obstore ``get_range`` (Rust object_store, releases the GIL), from a thread pool."""
    import obstore
    from obstore.store import S3Store

    store = S3Store.from_url(f"s3://{BUCKET}", client_options={"allow_http": True})

    def one(item: tuple[str, int, int]) -> bytes:
        key, start, stop = item
        return bytes(obstore.get_range(store, key, start=start, end=stop))

    return _pooled(one, concurrency)


def s3fs_reader(concurrency: int) -> Read:
    """s3fs (fsspec over aiobotocore) ``cat_ranges``: its own event loop does the concurrency."""
    import s3fs

    fs = s3fs.S3FileSystem(max_concurrency=concurrency)

    def read(items: list[tuple[str, int, int]]) -> list[bytes]:
        paths = [f"{BUCKET}/{key}" for key, _, _ in items]
        return fs.cat_ranges(paths, [s for _, s, _ in items], [e for _, _, e in items])

    return read


def _pooled(one: Callable[[tuple[str, int, int]], bytes], concurrency: int) -> Read:
    pool = concurrent.futures.ThreadPoolExecutor(concurrency)
    return lambda items: list(pool.map(one, items))


CLIENTS = {"boto3": boto3_reader, "obstore": obstore_reader, "s3fs": s3fs_reader}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--mb", type=float, default=2.0)
    parser.add_argument("--reads", type=int, default=800)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    size, span = int(args.mb * 1e6), args.kib * 1024
    with moto_server() as endpoint, s3_environment(endpoint):
        import boto3

        objects = {f"object-{n}": os.urandom(size) for n in range(args.objects)}
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for key, body in objects.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        items = []
        for _ in range(args.reads):
            key = rng.choice(list(objects))
            start = rng.randrange(0, size - span)
            items.append((key, start, start + span))
        readers = {name: make(args.concurrency) for name, make in CLIENTS.items()}
        best = {name: float("inf") for name in readers}
        for _ in range(args.rounds):
            for name, read in readers.items():
                began = time.perf_counter()
                got = read(items)
                best[name] = min(best[name], time.perf_counter() - began)
                wrong = sum(g != objects[k][s:e] for g, (k, s, e) in zip(got, items, strict=True))
                if wrong:
                    raise SystemExit(f"{name}: {wrong} of {len(items)} reads returned other bytes")
    for name, seconds in best.items():
        print(json.dumps({
            "row": name, "reads": args.reads, "kib": args.kib, "concurrency": args.concurrency,
            "reads_per_s": round(args.reads / seconds, 1),
            "mb_per_s": round(args.reads * span / seconds / 1e6, 1),
        }))  # fmt: skip
    ratios = {f"{name}_over_boto3": round(best["boto3"] / best[name], 2) for name in best}
    print(json.dumps({"row": "ratio", **ratios}))


if __name__ == "__main__":
    main()

"""Caches in an object store: ``s3://bucket/prefix`` read by ranged GETs, written by PUTs.

The client is boto3 (``pip install 'melcache[s3]'``), weighing ``benchmarks/store/s3_clients.py``
against fork-safety: obstore read 1.3–1.7× faster against a local moto server, but its Rust
runtime, once started in the loader's parent (which reads ``index.json``), hangs forked workers
(LitData #872); boto3 is plain Python and a client made after ``fork`` is safe. Credentials and endpoint come from the
standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, …, the default credential
chain), so any S3-compatible store (MinIO, Ceph RGW, R2) works. ``gs://bucket/prefix`` goes
through the same client, deadlines and retry budget, at GCS's S3 interoperability endpoint
(:data:`GCS_ENDPOINT`, or ``MELCACHE_GS_ENDPOINT``; credentials: GCS HMAC keys in the same
variables), never through webdataset's ``gsutil cat`` pipe, which had no deadline and ignored
SIGTERM. boto3 gives no ``az://``.

Clients are made lazily, one per process (a forked child never uses its parent's, and none is
ever pickled: callers hold locations, plain strings). botocore's own retries are off: it
neither resumes a body cut short nor counts a reset mid-body, so :func:`_ranged` retries with
full-jitter exponential back-off on 503 SlowDown, other 5xx, resets, timeouts and short bodies,
resuming from the last good byte; attempts that bring no byte count against the budget. A read
that still fails is a :class:`StoreError` (an ``OSError``) naming the object. At most
:data:`MAX_REQUESTS` requests of a process are in flight at once.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from melcache.errors import UserError

SCHEMES = ("s3://", "gs://")
GCS_ENDPOINT = "https://storage.googleapis.com"  # GCS's S3-compatible XML API
MAX_REQUESTS = 16  # in flight per process: a loader worker, a push thread pool
ATTEMPTS = 10  # failed attempts in a row (no byte gained) before a read gives up
# The first back-off's ceiling, doubled per failed attempt up to the cap: a lone 503 costs a
# few ms, a store that keeps refusing is left alone for seconds (10 attempts: ~10 s at most).
BACKOFF_S = 0.01
BACKOFF_CAP_S = 5.0
# Failures in a row for this long also end the attempts: a blackholed endpoint costs a connect
# timeout (5 s) per attempt, and a command on an unreachable store must end within ~30 s.
GIVE_UP_S = 20.0
CHUNK = 1 << 20  # a body is read in pieces: what arrived before a reset is kept

# Error codes worth another attempt: the store is busy or failed, not the request wrong.
_RETRY_CODES = {"SlowDown", "Throttling", "RequestTimeout", "InternalError", "ServiceUnavailable",
                "ConditionalRequestConflict"}  # fmt: skip
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}

_clients: dict[tuple[int, str], Any] = {}  # (pid, scheme) → client: a forked child makes its own
_limit = threading.BoundedSemaphore(MAX_REQUESTS)
_lock = threading.Lock()


def _after_fork() -> None:
    """A forked child starts with no client and fresh locks (a parent thread may have held
    them at the fork, and would never release them here)."""
    global _limit, _lock
    _clients.clear()
    _limit, _lock = threading.BoundedSemaphore(MAX_REQUESTS), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class StoreError(OSError):
    """An object that could not be read or written; the message names it and why."""


def is_store(location: object) -> bool:
    """True when ``location`` names an object-store prefix or object (``s3://…``, ``gs://…``)."""
    return isinstance(location, str) and location.startswith(SCHEMES)


def split(location: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key`` (or ``gs://``); :class:`UserError` without a bucket, or with a
    ``.``, ``..`` or empty path segment (a store does not resolve them: ``s3://b/../x`` would
    be the key ``../x``; a trailing ``/`` is allowed)."""
    scheme = location[: location.index("://") + 3]
    bucket, _, key = location.removeprefix(scheme).partition("/")
    if not bucket:
        raise UserError(f"{location}: no bucket named (expected {scheme}bucket/prefix)")
    segments = key.removesuffix("/").split("/") if key else []
    bad = next((s for s in segments if s in ("", ".", "..")), None)
    if bad is not None or bucket in (".", ".."):
        what = "an empty" if bad == "" else f"a {bad or bucket!r}"
        raise UserError(
            f"{location}: {what} path segment, which an object store keeps as part of the key "
            "instead of resolving it: name the prefix plainly (s3://bucket/path/to/cache)"
        )
    return bucket, key


def held_clients() -> int:
    """Clients this process holds now (the loader's parent holds none once workers run)."""
    return len(_clients)


def forget_clients() -> None:
    """Drop this process's clients (their connections close with them)."""
    with _lock:
        _clients.clear()


def _client(location: str) -> Any:
    """This process's client for ``location``'s store, made on first use."""
    at = (os.getpid(), location[:5])
    with _lock:
        if at not in _clients:
            for other in [k for k in _clients if k[0] != at[0]]:  # a fork that skipped the hook
                del _clients[other]
            _clients[at] = _new_client(at[1])
        return _clients[at]


def _new_client(scheme: str) -> Any:
    try:
        import boto3
        import botocore.config
    except ImportError:
        raise UserError(f"{scheme} caches need boto3: pip install 'melcache[s3]'") from None
    # botocore says at INFO where it found credentials, once per client: a line per worker.
    logging.getLogger("botocore").setLevel(max(logging.WARNING, logging.getLogger().level))
    config = botocore.config.Config(
        retries={"total_max_attempts": 1},  # ours resume; botocore's would start over
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=MAX_REQUESTS,
    )
    endpoint = os.environ.get("MELCACHE_GS_ENDPOINT", GCS_ENDPOINT) if scheme == "gs://" else None
    return boto3.session.Session().client("s3", config=config, endpoint_url=endpoint)


def read_object(location: str) -> bytes:
    """The whole object at ``location``; ``FileNotFoundError`` when there is none."""
    return _ranged(location, 0, None)


def read_range(location: str, offset: int, length: int) -> bytes:
    """``length`` bytes of the object at ``location`` from ``offset`` (fewer only when the
    object ends first: the caller compares with what its index says)."""
    return _ranged(location, offset, offset + length)


def list_sizes(prefix: str) -> dict[str, int]:
    """Name (below ``prefix``) → size of every object under the prefix ``s3://bucket/p``."""
    bucket, key = split(prefix)
    key = f"{key.rstrip('/')}/" if key else ""
    found: dict[str, int] = {}
    token: dict[str, str] = {}
    while True:
        asked = {"Bucket": bucket, "Prefix": key, **token}
        page = _retrying(prefix, lambda c, asked=asked: c.list_objects_v2(**asked))
        found.update({o["Key"][len(key) :]: o["Size"] for o in page.get("Contents", [])})
        if not page.get("IsTruncated"):
            return found
        token = {"ContinuationToken": page["NextContinuationToken"]}


def download_prefix(prefix: str, folder: Path) -> None:
    """Copy every object under ``prefix`` into ``folder``, as files named by the rest of their
    keys (for the few small objects of a group other libraries read from a folder)."""
    for name in list_sizes(prefix):
        path = folder / name
        if ".." in Path(name).parts or Path(name).is_absolute():  # a key is no path to follow
            raise StoreError(f"{prefix}/{name}: not a name inside the prefix")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read_object(f"{prefix.rstrip('/')}/{name}"))


def put_object(location: str, data: bytes, *, if_absent: bool = False) -> None:
    """Write ``data`` as the object at ``location`` (retried as reads are). With ``if_absent``
    the write is conditional (``If-None-Match: *``): ``FileExistsError`` when an object is
    already there, so of two writers racing for one name only the first writes it. A store
    that does not implement the condition gets a plain write after a check for the object,
    which leaves a window of one round trip."""
    bucket, key = split(location)
    if not if_absent:
        _retrying(location, lambda c: c.put_object(Bucket=bucket, Key=key, Body=data))
        return
    try:
        _retrying(
            location, lambda c: c.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        )
    except _Unconditional:
        if key_exists(location):
            raise FileExistsError(f"{location}: already there") from None
        _retrying(location, lambda c: c.put_object(Bucket=bucket, Key=key, Body=data))


def key_exists(location: str) -> bool:
    """Whether an object is at ``location``."""
    bucket, key = split(location)
    try:
        _retrying(location, lambda c: c.head_object(Bucket=bucket, Key=key))
    except FileNotFoundError:
        return False
    return True


def _retrying(location: str, request: Any) -> Any:
    """``request(client)`` (a request with no body to resume), retried as reads are."""
    failures, since = 0, time.monotonic()
    while True:
        try:
            with _limit:
                return _call(location, request, retry=True)
        except _Retry as exc:
            failures += 1
            if _spent(failures, since):
                raise StoreError(
                    f"{location}: giving up after {failures} attempts in "
                    f"{time.monotonic() - since:.0f} s ({exc})"
                ) from None
            _back_off(failures)


def _spent(failures: int, since: float) -> bool:
    """Whether a run of ``failures`` in a row, begun at ``since``, ends the attempts."""
    return failures >= ATTEMPTS or time.monotonic() - since >= GIVE_UP_S


def _back_off(failures: int) -> None:
    """Sleep before the next attempt: full jitter, so that the workers a 503 turned away do
    not come back together (mountpoint-s3 #743: too short a back-off keeps the store busy)."""
    time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_S * 2**failures)))


def _ranged(location: str, start: int, stop: int | None) -> bytes:
    """Bytes ``start`` to ``stop`` (the end when ``None``) of an object, resuming after each
    failure from the last good byte; a body cut short is a failure, never the end."""
    got = bytearray()
    failures, since = 0, time.monotonic()
    while True:
        at = start + len(got)
        if stop is not None and at >= stop:
            return bytes(got)
        try:
            total = _get_into(location, at, stop, got)
            if total is None or start + len(got) >= min(total, stop or total):
                return bytes(got)
            problem = f"body cut short at byte {start + len(got)}"
        except _Retry as exc:
            problem = str(exc)
        if start + len(got) > at:  # bytes gained: a new run of failures
            failures, since = 0, time.monotonic()
        else:
            failures += 1
        if _spent(failures, since):
            raise StoreError(
                f"{location}: giving up after {failures} attempts in "
                f"{time.monotonic() - since:.0f} s ({problem})"
            )
        _back_off(failures)


class _Retry(Exception):
    """A failure worth another attempt (the store busy, the connection lost)."""


class _Unconditional(StoreError):
    """The store does not implement conditional writes (``If-None-Match``)."""


def _get_into(location: str, at: int, stop: int | None, got: bytearray) -> int | None:
    """One GET of bytes ``at`` to ``stop`` appended to ``got`` piece by piece; the object's
    whole size (``None``: the range starts past its end, nothing to read)."""
    from botocore.exceptions import ClientError

    bucket, key = split(location)
    wanted = f"bytes={at}-" if stop is None else f"bytes={at}-{stop - 1}"
    with _limit:  # held for the body too: the connection is busy until it is read
        try:
            answer = _call(
                location, lambda c: c.get_object(Bucket=bucket, Key=key, Range=wanted), retry=True
            )
        except ClientError:  # InvalidRange: the range starts at or past the end
            return None
        content_range = answer.get("ContentRange") or ""
        total = int(content_range.rpartition("/")[2]) if "/" in content_range else None
        body = answer["Body"]
        try:
            for piece in body.iter_chunks(CHUNK):
                got += piece
        except Exception as exc:  # a reset or a short body mid-read: keep what came
            if not _transient(exc):
                raise
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        finally:
            body.close()
    return total if total is not None else at + len(got)


def _call(location: str, request: Any, *, retry: bool = False) -> Any:
    """``request(client)`` (the caller holds a place under :data:`MAX_REQUESTS`), its errors as one line naming ``location``: a missing object is
    ``FileNotFoundError``; with ``retry``, transient failures are :class:`_Retry` and an
    unsatisfiable range passes through, otherwise both are a :class:`StoreError`."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    try:
        return request(_client(location))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _MISSING_CODES:
            raise FileNotFoundError(f"{location}: no such object") from None
        if code == "PreconditionFailed" or status == 412:
            raise FileExistsError(f"{location}: already there") from None
        if code == "NotImplemented" or status == 501:
            raise _Unconditional(f"{location}: the store has no conditional writes") from None
        if retry and code == "InvalidRange":
            raise
        message = _client_problem(location, code, status, exc)
        if retry and (code in _RETRY_CODES or status >= 500):
            raise _Retry(message) from None
        raise StoreError(message) from None
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StoreError(
            f"{location}: no S3 credentials ({exc}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role applies"
        ) from None
    except Exception as exc:
        if not _transient(exc):
            raise
        if retry:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        raise StoreError(f"{location}: {type(exc).__name__}: {exc}") from None


def _client_problem(location: str, code: str, status: int, exc: Exception) -> str:
    """The store's refusal as one line naming the object, with the likely fix."""
    if code == "NoSuchBucket":
        return f"{location}: no bucket {split(location)[0]!r} at this endpoint"
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
        return f"{location}: access denied ({code}); check the credentials and the bucket policy"
    message = exc.response.get("Error", {}).get("Message", "")  # type: ignore[attr-defined]
    return f"{location}: the store answered {status} {code or ''} {message}".rstrip()


def _transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost connection, a timeout or a body cut short."""
    from botocore.exceptions import ConnectionError as LostConnection
    from botocore.exceptions import HTTPClientError, IncompleteReadError, ResponseStreamingError
    from urllib3.exceptions import HTTPError as Urllib3Error

    transient = (LostConnection, HTTPClientError, IncompleteReadError, ResponseStreamingError,
                 Urllib3Error)  # fmt: skip
    return isinstance(exc, (*transient, ConnectionError, TimeoutError))

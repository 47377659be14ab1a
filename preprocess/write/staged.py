"""``build --out s3://bucket/prefix``: a build staged in a local folder, published as it goes.

The build runs as a local one does, in a staging folder; this module carries between it and
the store what the parts of a build share. Each shard is uploaded as soon as it is written and
read back (push's :func:`publish`), then its table rows, then its receipt, and its staged copy
is deleted: a receipt in the store says its shard is there whole, and local disk holds only the
shards in flight. The parts meet through the store: a part's scan is uploaded once made, and the
other parts' scans and receipts are downloaded into the staging ``.build/`` before they are
counted. The part that finds every planned shard's receipt in the store writes rejected.jsonl,
stats.zarr and the table, then ``index.json`` by a conditional PUT (``If-None-Match: *``), so
of two parts finishing together one writes it and the other finds the same bytes there.
Every object is written whole under its final name, so a part killed at any moment and rerun
(with the same staging folder or none) ends with the same objects.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from melcache.errors import UserError
from melcache.format import INDEX_NAME, temp_owner, write_atomic
from melcache.location import member_location
from melcache.remote import objectstore
from preprocess.inputs.parquet import SPOOL
from preprocess.inputs.records import RECEIPTS
from preprocess.job.owners import MARKER_PREFIX
from preprocess.plan.scan import SCAN_META
from preprocess.plan.shard_plan import Plan
from preprocess.write.index_table import ROWS_FOLDER
from preprocess.write.mel_shard import valid_receipts
from preprocess.write.push import cache_files, listing, publish, remote_bytes

log = logging.getLogger(__name__)


def default_staging(destination: str) -> Path:
    """The staging folder of a build into ``destination`` when ``--staging`` is not given:
    under the system temp dir (``$TMPDIR``), named after the destination and the endpoint,
    so that a rerun on this machine finds what the first run staged."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    tag = hashlib.sha256(f"{endpoint} {destination}".encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", destination.removeprefix("s3://")).strip("-")
    return Path(tempfile.gettempdir()) / f"melcache-staging-{readable[:80]}-{tag}"


class StoreOut:
    """A build's destination in an object store, and the local folder it is staged in."""

    def __init__(self, destination: str, staging: Path) -> None:
        self.destination = destination.rstrip("/")
        self.staging = staging

    def check(self) -> None:
        """At the start: the store answers (a wrong bucket, missing credentials and an
        unreachable endpoint are one line each) and the prefix holds no cache that another
        command made (a pushed cache has no build state beside its index)."""
        present = listing(self.destination)
        state = any(name.startswith(f"{RECEIPTS}/") for name in present)
        if INDEX_NAME in present and not state:
            raise UserError(
                f"{self._at(INDEX_NAME)} exists and no build state is beside it: another "
                "cache is there; build to an empty prefix"
            )

    def pull_state(self) -> None:
        """Download the build state in the store (scans, receipts, table rows) that the
        staging folder lacks or holds at another size; each file is written atomically."""
        for name, size in listing(self._at(RECEIPTS)).items():
            path = self.staging / RECEIPTS / name
            if not _shared(name) or (path.is_file() and path.stat().st_size == size):
                continue
            if ".." in Path(name).parts or Path(name).is_absolute():  # a key is no path to follow
                raise UserError(f"{self._at(RECEIPTS)}/{name}: not a name inside the prefix")
            data = remote_bytes(self._at(f"{RECEIPTS}/{name}"))
            if data is not None:  # gone since the listing: a stale receipt another part dropped
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, data)

    def push_folder(self, folder: Path) -> None:
        """Upload every file under ``folder`` (a part's scan), kept where already there, its
        ``meta.json`` last: another part that finds it counts the scan as finished and reads
        every piece (sorted by name, it went before them, and a part read a missing piece)."""
        present = listing(self.destination)
        files = (p for p in folder.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: (p.name == SCAN_META, p.as_posix())):
            name = path.relative_to(self.staging).as_posix()
            if _shared(name.removeprefix(f"{RECEIPTS}/")):
                self._publish(name, present.get(name))

    def publish_shard(self, receipt: dict[str, Any]) -> None:
        """Upload a shard just written, its table rows, then its receipt (each read back),
        and delete the staged shard: from now on the store holds it."""
        name = receipt["name"]
        held = [name, f"{RECEIPTS}/{ROWS_FOLDER}/{name}.json"] if receipt["samples"] else []
        for relative in [*held, f"{RECEIPTS}/{name}.json"]:
            self._publish(relative, None)
        (self.staging / name).unlink(missing_ok=True)

    def complete(
        self, plan: Plan, made_by: str, part: tuple[int, int]
    ) -> dict[str, dict[str, Any]]:
        """The receipts of the planned shards that are in the store, after uploading this
        part's shards complete in the staging folder only (a run killed before it uploaded
        them). Other parts' are theirs to upload: they may share this staging folder."""
        self.pull_state()
        present = listing(self.destination)
        k, n = part
        own = {plan.name(i) for i in range(len(plan)) if i % n == k}
        try:
            staged = valid_receipts(self.staging, plan, made_by)
        except UserError:  # receipts of another plan, downloaded from the store or staged
            raise UserError(
                f"{self.destination} (staged in {self.staging}) holds a build of a different "
                "corpus or config; build to another prefix with another --staging"
            ) from None
        for receipt in staged.values():
            if receipt["name"] not in own:
                continue
            if _in_store(receipt, present):
                (self.staging / receipt["name"]).unlink(missing_ok=True)
            else:
                self.publish_shard(receipt)
        present = listing(self.destination)
        return valid_receipts(
            self.staging, plan, made_by, lambda receipt: _in_store(receipt, present)
        )

    def publish_cache(self, plan: Plan) -> bool:
        """Upload what the end of the build wrote in the staging folder, ``index.json`` last
        and only if no index is there yet; whether this call wrote it. An index already there
        must hold the same bytes (another part finished at the same moment)."""
        shards = {plan.name(i) for i in range(len(plan))}
        present = listing(self.destination)
        for name in cache_files(self.staging):
            if name not in shards:
                self._publish(name, present.get(name))
        index = (self.staging / INDEX_NAME).read_bytes()
        try:
            objectstore.put_object(self._at(INDEX_NAME), index, if_absent=True)
            written = True
        except FileExistsError:
            written = False
        except OSError as exc:
            raise UserError(str(exc)) from None
        if remote_bytes(self._at(INDEX_NAME)) != index:
            raise UserError(
                f"{self._at(INDEX_NAME)}: another index is there (another build of other "
                "inputs into this prefix?); build to an empty prefix"
            )
        return written

    def _at(self, name: str) -> str:
        return member_location(self.destination, name)

    def _publish(self, name: str, remote_size: int | None) -> None:
        """Upload the staged file ``name`` (read back); a store that fails past its retries
        is one line naming the object, and a rerun resumes."""
        try:
            publish(self.staging / name, self._at(name), remote_size)
        except OSError as exc:
            raise UserError(f"{exc}; rerun the same command to resume") from None


def _shared(name: str) -> bool:
    """Whether a file of ``.build/`` (named relative to it) is state the parts share: not a
    running build's marker, a temporary file or the Parquet spool, which stay on their host."""
    first = name.split("/", 1)[0]
    leaf = name.rsplit("/", 1)[-1]
    return not (
        first.startswith(MARKER_PREFIX)
        or first == SPOOL
        or temp_owner(leaf)
        or leaf.endswith(".tmp")
    )


def _in_store(receipt: dict[str, Any], present: dict[str, int]) -> bool:
    """Whether a shard is complete in the store: its receipt is there (uploaded after the
    shard and its rows), and the shard at the size the receipt says."""
    if f"{RECEIPTS}/{receipt['name']}.json" not in present:
        return False
    return receipt["samples"] == 0 or present.get(receipt["name"]) == receipt["bytes"]

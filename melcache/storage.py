"""The ways a mel can be stored in a shard, by name: what a config, the command line and the
index say, and which member holds it. The codecs are in :mod:`melcache.codec`; this module
stays free of torch so that ``--help`` and config parsing stay fast.

- ``fp16`` (the default): ``<key>.mel.npy``, float16 in ``np.save`` format.
- ``lz4-q5``: ``<key>.mel.q5``, the float32 log-mel rounded to steps of 2^-5 log units (no
  value off by more than 2^-6, the error of Lhotse's lilcom default), 2-D delta coded,
  bit-shuffled and compressed with LZ4: under half of fp16's bytes.

The storage is recorded in the index (``build.storage``, absent in caches built before it
existed, which are fp16) and in each mel member's name, so readers never guess.
"""

from __future__ import annotations

FP16 = "fp16"
COMPACT = "lz4-q5"
STORAGES = (FP16, COMPACT)
MEL_MEMBERS = {FP16: "mel.npy", COMPACT: "mel.q5"}
STORAGE_OF_MEMBER = {member: storage for storage, member in MEL_MEMBERS.items()}
# Bytes per mel value, to size shards while planning: fp16 exactly, lz4-q5 as measured on
# speech with silences (0.94); a shard a little over or under its byte budget is harmless.
BYTES_PER_VALUE = {FP16: 2.0, COMPACT: 0.95}
STEP = 2.0**-5  # lz4-q5's quantisation step: a value is within STEP / 2 of the float32 mel

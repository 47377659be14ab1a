"""Plan: what is written where, fixed before decoding (the scan, the shard plan); imports melcache, preprocess.config, inputs and job."""

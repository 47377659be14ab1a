"""Plan: what is written where, fixed before decoding; imports melcache, config, inputs, job."""

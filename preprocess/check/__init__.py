"""Check: read a finished cache back (verify, inspect, show); imports melcache, preprocess.config, inputs, plan, write and job."""

"""Check: read a finished cache back; imports melcache, config, inputs, plan, write, job."""

"""Write: extract, write the shards (mel and field), finish the cache and publish it; imports melcache, config, inputs, plan, job."""

"""Write: extract, write a shard, finish the cache; imports melcache, config, inputs, plan, job."""

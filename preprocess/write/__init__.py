"""Write: decode, extract and write a shard, and finish the cache; imports melcache, preprocess.config, inputs, plan and job."""

"""How a cache is stored and reached: mel storage, audio tars, random access, S3 clients and faults."""

"""Job: how the processes of a build cooperate (parts, owners, the worker pool); imports melcache and nothing else of preprocess."""

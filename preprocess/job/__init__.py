"""Job: how the processes of a build cooperate (parts, owners, pool); imports melcache only."""

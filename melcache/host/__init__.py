"""What melcache asks of the machine it runs on: the CPUs this process may use (``cpus``) and
one owner per folder (``lock``: a lock file naming its holder's host and pid)."""

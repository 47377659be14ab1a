"""Exceptions the command line turns into one clear message and exit status 2."""


class UserError(Exception):
    """Bad input from the user (a path, a config key, a corpus): print the message, exit 2."""


class ShardError(Exception):
    """A shard or sample that cannot be read as melcache data; the message names the shard."""

"""Exceptions the command line turns into one clear message and exit status 2."""


class UserError(Exception):
    """Bad input from the user (a path, a config key, a corpus): print the message, exit 2."""


class ShardError(Exception):
    """A shard or sample that cannot be read as melcache data; the message names the shard."""


class UserCodeError(UserError):
    """Code the user plugged in (an encoder, its factory) failed: a line naming it and what it
    was given, then that code's own frames of the traceback (the house's and libraries' left
    out), as text, so it survives a worker process's pickling."""


def user_code_error(what: str, exc: BaseException) -> UserCodeError:
    """:class:`UserCodeError` for ``exc`` raised inside the user's code that ``what`` names."""
    import sysconfig
    import traceback
    from pathlib import Path

    house = Path(__file__).resolve().parents[1]
    skipped = [str(house / p) for p in ("melcache", "preprocess", "train")]
    skipped += [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")]
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not str(Path(f.filename).resolve()).startswith(tuple(skipped))
    ]
    line = f"{what}: {type(exc).__name__}: {' '.join(str(exc).split())}"
    below = "".join(traceback.format_list(frames)).rstrip()
    return UserCodeError(f"{line}\n{below}" if below else line)

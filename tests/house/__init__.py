"""House-wide checks: import layers and file sizes, documented paths, the front page, install, extras, pytest's abort report."""

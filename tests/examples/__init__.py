"""The plug-in examples (examples/) with their real packages."""

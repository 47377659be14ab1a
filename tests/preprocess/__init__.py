"""The build and its commands (preprocess/): build, derive, verify, inspect."""

"""The `rewy-tune` command line."""

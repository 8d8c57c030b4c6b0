"""The `translate` command-line client."""

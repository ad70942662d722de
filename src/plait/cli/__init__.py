"""The `plait` command line: thin parsers that build configs and call down into the library."""

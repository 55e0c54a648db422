"""One module per CLI verb: what `kvprof VERB` runs (the parser is kvprof/cli.py)."""

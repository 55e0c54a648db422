"""What the numbers look like: the dashboard's snapshot and TUI, text/JSON/HTML reports,
findings, compare, Prometheus. Views compute nothing."""

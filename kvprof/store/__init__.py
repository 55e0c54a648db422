"""Rows kept: the DuckDB session (session.py) and its Parquet export (parquet.py)."""

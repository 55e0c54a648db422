"""From stored rows to every measure: row sources (SQL or the live cache), the phase fold,
correlate, fleet sums."""

"""Phase sources: each turns what it observes into rows of the `phase` table."""

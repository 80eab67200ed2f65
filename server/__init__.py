"""FastAPI dashboard and JSON API over the winners database (read-only)."""

"""SQLAlchemy models, engine setup, queries and migrations of the winners database.

Open it with `open_db(url, read_only=...)`; every read and write is a function in `queries`
(winners exchange as JSON in `exchange`). Nothing outside this package writes SQL.
"""

from .engine import Database, default_db_url, open_db
from .errors import DatabaseError

__all__ = ["Database", "DatabaseError", "default_db_url", "open_db"]

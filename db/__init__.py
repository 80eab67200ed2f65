"""SQLAlchemy models, engine setup, queries and migrations of the winners database."""

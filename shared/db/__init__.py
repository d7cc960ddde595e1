"""The database: one engine per process, the SQL schema, and migrations."""

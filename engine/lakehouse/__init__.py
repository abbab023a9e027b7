"""The lakehouse: where each table lives, creating and migrating tables, the Delta log,
the SQL catalog, the Spark session and files. Imports only ``engine.core``."""

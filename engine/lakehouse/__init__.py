"""The lakehouse, one concern per subpackage; imports only ``engine.core``.

- ``storage``: where files live (a local folder or an S3 bucket), small files, and where each
  table lives (``layout``).
- ``delta``: Delta tables read and written from the driver (the log appender, delta-rs in
  Arrow, live files, checkpoints), and creating and migrating the engine's tables.
- ``catalog``: names in the SQL catalog, the views, the embedded metastore and the Spark session.
- ``state``: the engine's own state beside the tables: the lease and the offset logs.

Layers, checked by ``make imports``: ``catalog`` and ``state`` over ``delta`` over ``storage``.
"""

"""Names in the SQL catalog: registrations, the views' SQL, the embedded metastore, and the Spark
session that serves them."""

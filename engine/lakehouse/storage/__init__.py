"""Where the lakehouse's files live: stores (a local folder, an S3 bucket), their settings,
small files, and where each table lives (``layout``)."""

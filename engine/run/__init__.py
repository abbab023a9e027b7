"""The running engine: the stamping stream and the delivery stage in one application."""

"""The running engine: the stamping and delivery stages in one application."""

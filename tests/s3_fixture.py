"""Placeholder: the loopback S3 server fixture is added with the storage conformance suite."""

"""One-process tests."""

"""The operator's policy file: its schema, and a loader whose errors name file, line and column."""

"""Graph-level placement analysis helpers."""

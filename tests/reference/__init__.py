"""Independent references that optimised paths are checked and measured against."""

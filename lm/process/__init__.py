"""Process-level set-up: backend flags, huge pages, multi-host joining."""

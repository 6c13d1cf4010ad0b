"""The embedded end-to-end demo run, its MoE and serving parts, and its evidence table."""

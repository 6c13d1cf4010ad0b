"""The generation engine: paged KV pool, continuous batching (engine.py), its compiled steps
(steps.py), per-request sampling (rows.py), page bookkeeping (pages.py) and placement (pool.py)."""

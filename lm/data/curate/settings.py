"""The `curate` config section's stage names and value checks, which live with the section
(lm.config.curate) so that a run checks its settings before any data work."""

from lm.config.curate import DEDUP_STAGES, FILTER_STAGES, check_config, n_gram_fracs

__all__ = ["DEDUP_STAGES", "FILTER_STAGES", "check_config", "n_gram_fracs"]

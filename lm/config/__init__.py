"""The config: a ConfigDict of sections, loaded from Python files with dotted overrides.

`base_config()` is the schema: every key that exists, with its default and type. A config file
defines `get_config()` returning a ConfigDict whose keys must all exist in the schema; its values
are merged over the defaults and checked. The machinery is in `core`; each section (`model`,
`data`, ..., `distill`) is a module of its own holding its defaults, allowed values, checks and,
where its consumers read one, its frozen dataclass. Nothing here imports jax.
"""

from lm.config.core import ConfigDict, apply_overrides, load_file, merge, require
from lm.config.data import data_sources
from lm.config.eval import parse_sets
from lm.config.mesh import DEFAULT_RULES, rules_table
from lm.config.model import LORA_TARGETS, head_dim
from lm.config.schema import CHOICES, SECTIONS, base_config, init_of, load_config, validate

__all__ = [
    "CHOICES",
    "DEFAULT_RULES",
    "LORA_TARGETS",
    "SECTIONS",
    "ConfigDict",
    "apply_overrides",
    "base_config",
    "data_sources",
    "head_dim",
    "init_of",
    "load_config",
    "load_file",
    "merge",
    "parse_sets",
    "require",
    "rules_table",
    "validate",
]

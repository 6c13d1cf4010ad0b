"""The config: sections loaded from Python files with dotted overrides, then frozen.

`base_config()` is the schema: every key that exists, with its default and type. A config file
defines `get_config()` returning a ConfigDict whose keys must all exist in the schema; its values
are merged over the defaults and checked, and `load_config` returns the frozen `Config` (a frozen
dataclass per section, lm.config.frozen) that the code below the CLI reads. The machinery is in
`core`; each section (`model`, `data`, ..., `distill`) is a module of its own holding its
defaults, allowed values and checks; its frozen class is generated from its defaults and set on
the module (`lm.config.train.Train`). Nothing here imports jax.
"""

from lm.config.core import ConfigDict, apply_overrides, load_file, merge, require
from lm.config.data import data_sources
from lm.config.eval import parse_sets
from lm.config.frozen import thaw
from lm.config.mesh import DEFAULT_RULES, rules_table
from lm.config.model import LORA_TARGETS, head_dim
from lm.config.schema import CHOICES, SECTIONS, Config, base_config, freeze, init_of, load_config, validate, with_values

__all__ = [
    "CHOICES",
    "Config",
    "DEFAULT_RULES",
    "LORA_TARGETS",
    "SECTIONS",
    "ConfigDict",
    "apply_overrides",
    "base_config",
    "data_sources",
    "freeze",
    "head_dim",
    "init_of",
    "load_config",
    "load_file",
    "merge",
    "parse_sets",
    "require",
    "rules_table",
    "thaw",
    "validate",
    "with_values",
]

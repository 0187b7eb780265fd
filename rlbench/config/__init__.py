"""Configuration: typed schemas (schema.py), the schema walk (walk.py), where a value came from
(origin.py), the registered pieces (pieces.py), cross-field checks (checks.py) and the listing
command (list.py)."""

from rlbench.config.checks import notice_inactive_terms, resolve_device, validate_config

__all__ = ["notice_inactive_terms", "resolve_device", "validate_config"]

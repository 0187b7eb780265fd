"""Guided experience: strategies whose groups hold responses the current policy did not sample for the
prompt as it stands: replayed successes (replay, adaptive, difficulty_adaptive), guidance traces
(mixed_traces, references), hints (hint_reroll, scaf_hints, icl_expert; hints.py), trace prefixes
(guided_prefix, dataset_reset), edits (edit_injection) and an experience library in the prompt
(experience_library). One module per strategy, named as it is registered, plus the helpers they share
(hints.py); every module here is imported, so a new strategy is its module and its YAML."""

from rlbench.algorithm.registry import import_family_modules

import_family_modules(__name__, __path__)

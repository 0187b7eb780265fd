"""Configuration, the bottom layer beside rlbench.errors: typed schemas (schema.py), the schema walk
(walk.py), where a value came from (origin.py) and whether a run fits the device (fit.py). It imports
nothing from the packages it describes; the validation that needs their code (registries, cross-field
checks) is the run layer's, rlbench/validation.py."""

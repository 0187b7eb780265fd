"""Name -> function registries for the pieces an algorithm is composed of.

Every piece is a pure tensor function registered under the name its YAML uses. ``call`` passes a
piece exactly the inputs its signature asks for, plus the parameters from the config; a config key
the function does not take is a :class:`ConfigError` (a typo never silently does nothing).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from rlbench.errors import ConfigError


class Registry:
    """A named collection of functions of one kind (advantage estimator, policy loss, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._functions: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def decorator(fn: Callable) -> Callable:
            existing = self._functions.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"{self.kind} '{name}' is already registered to {existing.__qualname__}")
            self._functions[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        try:
            return self._functions[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} '{name}'; choose one of: {', '.join(sorted(self._functions))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._functions)

    def __contains__(self, name: str) -> bool:
        return name in self._functions

    def call(self, name: str, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """Call piece ``name`` with the ``inputs`` it declares and the config ``params``.

        ``inputs`` holds everything the trainer can offer (tensors); ``params`` are the YAML knobs.
        """
        fn = self.get(name)
        signature = inspect.signature(fn)
        accepted = set(signature.parameters)
        unknown = set(params) - accepted
        if unknown:
            raise ConfigError(
                f"{self.kind} '{name}' has no parameter(s) {sorted(unknown)}; "
                f"it takes: {sorted(accepted - set(inputs))}"
            )
        kwargs = {k: v for k, v in inputs.items() if k in accepted}
        kwargs.update(params)
        missing = [
            p.name
            for p in signature.parameters.values()
            if p.default is inspect.Parameter.empty and p.name not in kwargs
        ]
        if missing:
            raise ConfigError(f"{self.kind} '{name}' needs {missing}, which this run does not provide")
        return fn(**kwargs)

    def accepted_inputs(self, name: str) -> set[str]:
        """Every parameter name of the piece (inputs and knobs)."""
        return set(inspect.signature(self.get(name)).parameters)

    def required_inputs(self, name: str, params: Mapping[str, Any]) -> set[str]:
        """Parameters without a default that the config does not set: inputs the trainer must offer."""
        return {
            p.name
            for p in inspect.signature(self.get(name)).parameters.values()
            if p.default is inspect.Parameter.empty and p.name not in params
        }

    def validate_params(self, name: str, params: Mapping[str, Any], provided_inputs: set[str]) -> None:
        """Check ``params`` against the piece's signature without running it (for early validation)."""
        fn = self.get(name)
        accepted = set(inspect.signature(fn).parameters)
        unknown = set(params) - accepted
        if unknown:
            raise ConfigError(
                f"{self.kind} '{name}' has no parameter(s) {sorted(unknown)}; "
                f"it takes: {sorted(accepted - provided_inputs)}"
            )


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")

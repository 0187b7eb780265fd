"""Name -> function registries for the pieces an algorithm is composed of.

Every piece is a pure tensor function registered under the name its YAML uses. ``call`` passes a
piece exactly the inputs its signature asks for, plus the parameters from the config; a config key
the function does not take is a :class:`ConfigError` (a typo never silently does nothing).

A piece declares what it needs where it is registered: the inputs it reads are its signature's
parameters (each one an entry of rlbench.algorithm.step_inputs.STEP_INPUTS); what it demands of the rest of the composition (a required aggregation, one advantage
per response, ...) are :class:`Needs` given to ``register``. The composition reads both from here,
so a new piece is one function plus one YAML, with no central list to edit.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rlbench.algorithm.step_inputs import READERS, STEP_INPUTS
from rlbench.errors import ConfigError

LEVELS = ("sequence", "token")


@dataclass(frozen=True)
class Needs:
    """What a registered piece declares about the composition it takes part in.

    advantage_level    advantage estimator: "token" when its advantage varies along a response,
                       None (the default) when it gives one value per response;
                       policy loss: "sequence" when it needs one advantage per response (None: any)
    ratio_level        policy loss: "token" | "sequence", the level at which it forms its
                       importance ratio (a config asking for the other level is a conflict)
    aggregation        policy loss: the only aggregation under which its matrix gives the paper's
                       objective; any other is a config error (None: any)
    paper_aggregation  policy loss: the aggregation its paper / reference code uses (advisory)
    conflicts          why, in words, for the validator's error message (required with any of the
                       enforced needs above)
    on_policy          why the piece is defined only on data sampled by the current policy (no
                       importance ratio to correct stale data); a run that trains on stale data
                       (trainer.max_staleness >= 1) is refused, naming the piece. None: it takes any data
    ratio_term         policy loss: the term that sets it apart from its base loss, in words (or a
                       function of the loss's YAML parameters giving the words or None), when that
                       term acts only where the importance ratio pi_theta / pi_old differs from 1 (zero
                       effect on the gradient at ratio 1). With one update per batch on fresh data every
                       sampled token has ratio 1 and the run trains the base loss: the runner says so in
                       one line at start-up (rlbench.validation.notice_inactive_terms). None: the
                       piece's own terms act at ratio 1 too (PPO-clip's clip is the shared trust
                       region of the PPO family, not a term that sets a loss apart: ppo_clip declares none)
    ratio_term_metric  policy loss: the metric (a fraction of tokens) that is above 0 where that term
                       acted, e.g. "dropped_fraction" (None: the term has no such metric)
    whole_groups       policy loss: why it reads the responses of a group together (a pairwise preference
                       loss): the trainer then keeps every group in one micro-batch and one mini-batch
                       (rlbench.training.batch.group_micro_batches). None: rows are independent
    rounds             policy loss: what its pi_old is in an iterative method's rounds (INPO, REBEL: the frozen
                       pi_t of a round), when it may be held for several steps (algorithm.update.round_steps,
                       rlbench/training/rounds.py). None: pi_old is each step's sampling policy and
                       round_steps is refused
    check_params       a function of the piece's knobs (the YAML's, the signature's defaults for the rest) that
                       raises ConfigError on a bad value, called by ``validate_params`` before anything loads
                       (None: no check beyond the names)
    """

    advantage_level: str | None = None
    ratio_level: str | None = None
    aggregation: str | None = None
    paper_aggregation: str | None = None
    conflicts: tuple[str, ...] = ()
    on_policy: str | None = None
    ratio_term: str | Callable[[Mapping[str, Any]], str | None] | None = None  # or of the YAML params
    ratio_term_metric: str | None = None
    whole_groups: str | None = None
    rounds: str | None = None
    check_params: Callable[[Mapping[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        for key in ("advantage_level", "ratio_level"):
            value = getattr(self, key)
            if value is not None and value not in LEVELS:
                raise ValueError(f"{key} must be one of {LEVELS} or None, got {value!r}")
        enforced = self.aggregation is not None or self.ratio_level is not None or self.advantage_level == "sequence"
        if enforced and not self.conflicts:
            raise ValueError("a piece that constrains the composition must say why (conflicts)")
        if self.ratio_term_metric is not None and self.ratio_term is None:
            raise ValueError("ratio_term_metric names the metric of a ratio_term: declare the term (ratio_term)")

    @property
    def token_level_advantage(self) -> bool:
        return self.advantage_level == "token"


def import_family_modules(package: str, path: list[str]) -> None:
    """Import every module of ``package`` (its ``__path__``), so that the pieces of a new family
    module register without an edit to the package's ``__init__``."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


class Registry:
    """A named collection of functions of one kind (advantage estimator, policy loss, ...)."""

    def __init__(self, kind: str, reader: str):
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        self.kind = kind
        self.reader = reader  # the pieces' kind in STEP_INPUTS (rlbench/algorithm/step_inputs.py)
        self._functions: dict[str, Callable] = {}
        self._needs: dict[str, Needs] = {}

    def register(self, name: str, **needs: Any) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` under ``name`` with its :class:`Needs` (keyword arguments)."""
        declared = Needs(**needs)

        def decorator(fn: Callable) -> Callable:
            existing = self._functions.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"{self.kind} '{name}' is already registered to {existing.__qualname__}")
            self._functions[name] = fn
            self._needs[name] = declared
            return fn

        return decorator

    @property
    def inputs(self) -> frozenset[str]:
        """Every input name a piece of this kind may declare (the rest of a signature are YAML knobs):
        the STEP_INPUTS entries it reads."""
        return STEP_INPUTS.names(self.reader)

    def needs(self, name: str) -> Needs:
        """What piece ``name`` declared at registration (:class:`Needs`)."""
        self.get(name)
        return self._needs[name]

    def ratio_term(self, name: str, params: Mapping[str, Any]) -> str | None:
        """Needs.ratio_term of piece ``name`` under its YAML ``params``: the words, or None."""
        term = self.needs(name).ratio_term
        return term(params) if callable(term) else term

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

    def validate_params(self, name: str, params: Mapping[str, Any], provided_inputs: set[str] | None = None) -> None:
        """Check ``params`` against the piece's signature without running it (for early validation).
        ``provided_inputs`` (default: the registry's ``inputs``) are left out of the error message."""
        provided_inputs = self.inputs if provided_inputs is None else provided_inputs
        fn = self.get(name)
        accepted = set(inspect.signature(fn).parameters)
        unknown = set(params) - accepted
        if unknown:
            raise ConfigError(
                f"{self.kind} '{name}' has no parameter(s) {sorted(unknown)}; "
                f"it takes: {sorted(accepted - provided_inputs)}"
            )
        check = self._needs[name].check_params
        if check is not None:
            defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}
            check({**defaults, **params})


# The kinds of piece; the inputs each may declare are the STEP_INPUTS entries naming it as a reader.
ADVANTAGES = Registry("advantage estimator", reader="advantage")
POLICY_LOSSES = Registry("policy loss", reader="loss")
AGGREGATIONS = Registry("loss aggregation", reader="aggregation")
KL_ESTIMATORS = Registry("KL estimator", reader="kl")

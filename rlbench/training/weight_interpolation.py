"""P-SACPO's weight interpolation (Wachi et al. 2024, "Stepwise Alignment for Constrained Language Model Policy
Optimization", arXiv:2404.11049, P-SACPO): instead of re-running stage 2 for every Lagrange multiplier lambda, merge
the stage-1 model theta_1 and a stage-2 model theta_2 linearly,

    theta_w = (1 - w) theta_1 + w theta_2,    w in [0, 1],

w = 0 being the stage-1 model and w = 1 the stage-2 model, and choose w on the trade-off between the objectives.

A SACPO run (algorithm=sacpo with trainer.save_model=true) leaves both as Hugging Face folders: ``<run>/reference``
(the policy at the stage switch, stage 2's reference) and ``<run>/policy`` (the final policy). This command writes
one folder per w, each loadable with ``model=checkpoint model.path=<out>/w_<w>``:

    python -m rlbench.training.weight_interpolation <run>/reference <run>/policy --weights 0,0.5,1 --out <out>
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from rlbench.errors import ConfigError
from rlbench.training.reference_soup import weighted_average
from rlbench.utils import temporary_sibling

log = logging.getLogger(__name__)


def interpolate_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], w: float) -> dict[str, torch.Tensor]:
    """(1 - w) first + w second for each parameter (float64 arithmetic, ``first``'s dtypes): w = 0 gives
    ``first`` and w = 1 ``second`` exactly."""
    return weighted_average([first, second], [1.0 - w, w])


def parse_weights(text: str) -> list[float]:
    """``"0,0.5,1"`` -> [0.0, 0.5, 1.0]; every weight in [0, 1], none repeated (a ConfigError otherwise)."""
    try:
        weights = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--weights={text!r}: give numbers separated by commas, e.g. 0,0.5,1") from None
    if not weights or any(not 0.0 <= w <= 1.0 for w in weights) or len(set(weights)) != len(weights):
        raise ConfigError(f"--weights={text!r}: give distinct weights in [0, 1] (0: the first model, 1: the second)")
    return weights


def folder_name(w: float) -> str:
    """The output folder of weight ``w``: ``w_0.25``."""
    return f"w_{w:g}"


def write_interpolations(first: str | Path, second: str | Path, weights: Sequence[float], out: str | Path) -> list[Path]:
    """Load the two Hugging Face folders (the same architecture, else a ConfigError before anything is written)
    and write ``out/w_<w>`` for each weight: the interpolated model and ``first``'s tokenizer, each folder
    written under a temporary name and renamed when complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for path in (first, second):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{path} is not a Hugging Face checkpoint folder (no config.json; a SACPO run with "
                              "trainer.save_model=true writes <run>/reference and <run>/policy)")
    model = AutoModelForCausalLM.from_pretrained(str(first), dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(str(second), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(first))
    theta_1 = {name: p.detach().clone() for name, p in model.named_parameters()}
    theta_2 = {name: p.detach() for name, p in other.named_parameters()}
    if list(theta_1) != list(theta_2) or any(theta_1[n].shape != theta_2[n].shape for n in theta_1):
        raise ConfigError(f"{first} and {second} are not checkpoints of one architecture (parameter names or shapes differ)")
    written = []
    for w in weights:
        with torch.no_grad():
            for name, value in interpolate_weights(theta_1, theta_2, w).items():
                model.get_parameter(name).copy_(value)
        target = Path(out) / folder_name(w)
        tmp = temporary_sibling(target)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
        log.info("wrote %s (w=%g)", target, w)
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlbench.training.weight_interpolation",
                                     description="P-SACPO: write (1 - w) theta_1 + w theta_2 for each w")
    parser.add_argument("first", help="theta_1: a Hugging Face folder (a SACPO run's <run>/reference)")
    parser.add_argument("second", help="theta_2: a Hugging Face folder of the same architecture (<run>/policy)")
    parser.add_argument("--weights", default="0,0.25,0.5,0.75,1", help="comma-separated w in [0, 1]")
    parser.add_argument("--out", required=True, help="the folder to write w_<w>/ into")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for path in write_interpolations(args.first, args.second, parse_weights(args.weights), args.out):
            print(path)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()

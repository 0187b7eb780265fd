"""The ``rlbench`` console script: a Hydra app over conf/.

Every run writes ``status.json`` (rlbench/logger/run_status.py): running, then finished or failed
with the error. In a sweep (``-m``) a failing run is recorded and the sweep goes on with the next
point; the sweeper (hydra_plugins/rlbench_sweeper) validates every point before the first starts,
skips points that already finished and reports what failed at the end.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from rlbench.errors import AlreadyFinished, ConfigError, DataError, error_message
from rlbench.logger.run_status import (
    FAILED, FINISHED, INTERRUPTED, RUNNING, command_line_overrides, config_key, in_sweep, read_status,
)
from rlbench.logger.run_status import write_status as write_run_status

log = logging.getLogger("rlbench")

# conf/ sits next to the package (the repository layout mirrors config groups and packages).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def write_status(*args, **kwargs) -> None:
    """status.json of the run: written by rank 0 alone under torchrun (trainer.parallelism=ddp|fsdp)."""
    if os.environ.get("RANK", "0") == "0":
        write_run_status(*args, **kwargs)


VERBOSE_ENV = "RLBENCH_VERBOSE"  # 1: third-party progress bars, infos and warnings as their libraries print them


def quiet_console(rank: str, verbose: bool) -> None:
    """Unless ``verbose``: transformers' and the Hub's progress bars and infos off, Python warnings
    (deprecations) off. On a rank other than 0 (torchrun) only warnings and errors are logged and no
    Python warnings shown, so every line appears once."""
    import warnings

    if rank != "0":
        logging.getLogger().setLevel(logging.WARNING)
        log.setLevel(logging.WARNING)
        warnings.simplefilter("ignore")
    if verbose:
        return
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", FutureWarning)
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig) -> float | None:
    quiet_console(os.environ.get("RANK", "0"), os.environ.get(VERBOSE_ENV, "") not in ("", "0"))
    from rlbench.runner import run
    from rlbench.training.interrupt import Interrupted

    out_dir, key, previous = None, "", None
    try:
        out_dir = Path(cfg.output_dir)
        key = config_key(OmegaConf.to_container(cfg, resolve=True))
        previous = read_status(out_dir) if cfg.resume else None  # a resumed run's: kept if it had finished
        write_status(out_dir, RUNNING, key, run_name=cfg.run_name, overrides=command_line_overrides(),
                     **({"previous_status": previous.get("status")} if previous else {}))
        summary = run(cfg)
    except AlreadyFinished as finished:  # resume= of a finished run: its status and files stay as they were
        if previous:
            write_status(out_dir, previous.pop("status"), previous.pop("config_key", key), **previous)
        print(f"rlbench: {finished}", file=sys.stderr)
        return None
    except Interrupted as stopped:  # Ctrl-C / SIGTERM: a checkpoint and the summary are written
        write_status(out_dir, INTERRUPTED, key, run_name=cfg.run_name, signal=stopped.signal_name,
                     exit_code=stopped.exit_code, overrides=command_line_overrides())
        print(f"rlbench: {stopped}; resume with: rlbench resume={out_dir}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except Exception as err:
        message = error_message(err)
        if out_dir is not None:
            write_status(out_dir, FAILED, key, error=message, traceback=traceback.format_exc(),
                         overrides=command_line_overrides())
        expected = isinstance(err, (ConfigError, DataError, MissingMandatoryValue))
        if in_sweep():  # record it and let the sweep go on with the next point
            log.error("run failed: %s", message, exc_info=not expected)
            return None
        if not expected:
            raise
        fail(message)
    write_status(out_dir, FINISHED, key, run_name=cfg.run_name, overrides=command_line_overrides())
    after = summary.get("pass_at_1_after") or {}
    if "macro_avg" in after:  # for sweepers that optimise: the macro average over benchmarks
        return after["macro_avg"]
    return sum(after.values()) / len(after) if after else None


def fail(message: str) -> None:
    log.error("%s", message)
    print(f"rlbench: {message}", file=sys.stderr)
    sys.exit(2)


PLAIN_OVERRIDE = re.compile(r"^(?!hydra\.)([A-Za-z_]\w*(?:\.\w+)+)=")


def check_plain_overrides(args: list[str]) -> None:
    """A plain ``a.b=value`` override of a key the config does not have exits 2, naming the key and its
    nearest spelling, before Hydra refuses it with its own error (exit 1). ``++``/``+`` overrides are
    checked against the schemas later (rlbench.config.walk). In a sweep (``-m``) the overrides with one
    value are checked here (Hydra applies them before the sweeper starts); swept ones by the sweeper."""
    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in args):
        return
    if any(arg in ("-m", "--multirun") for arg in args):
        args = [arg for arg in args if arg not in ("-m", "--multirun") and "," not in arg.partition("=")[2]]
    plain = {m.group(1): arg for arg in args if (m := PLAIN_OVERRIDE.match(arg))}
    if not plain:
        return
    from hydra import compose, initialize_config_dir

    from rlbench.config.walk import unknown_override_message

    others = [arg for arg in args if arg not in plain.values() and not arg.startswith("hydra.")]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            cfg = compose("config", overrides=others)
        except Exception:  # a bad group choice or value: Hydra's own message names it
            return
    for key, arg in plain.items():
        message = unknown_override_message(cfg, key, arg)
        if message:
            fail(message)


GROUP_CHOICE = re.compile(r"^([A-Za-z_][\w/]*)=([^()\[\]{}]+)$")  # group=option (a sweep: a,b,c)


def unknown_option_message(arg: str) -> str | None:
    """For ``group=option`` (or a sweep's ``group=a,b``) naming an option the group does not have: the
    message with the nearest option names (instead of Hydra's list of every option); else None."""
    match = GROUP_CHOICE.match(arg)
    folder = Path(CONF_DIR) / match.group(1) if match else None
    if folder is None or not folder.is_dir() or match.group(1).split("/")[0] == "hydra":  # Hydra's plugins add options
        return None
    group = match.group(1)
    unknown = [v.strip() for v in match.group(2).split(",")
               if v.strip() and v.strip() != "null" and not (folder / f"{v.strip()}.yaml").is_file()]
    if not unknown:
        return None
    import difflib

    from rlbench.listing import group_options

    options = group_options()[group]
    closest = difflib.get_close_matches(unknown[0], options, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(closest)}? " if closest else ""
    return (f"{arg}: {group} has no option '{unknown[0]}'; {hint}(rlbench-list shows all {len(options)} "
            f"{group} options)")


def explain_override_error(overrides: list[str], compose) -> str | None:
    """A sweep point Hydra refused, said as a single run says it: an unknown group option with its
    nearest names, or an unknown key with its nearest spelling (``compose(overrides)`` -> the config
    without the bad key); None when neither explains it."""
    from rlbench.config.walk import unknown_override_message

    for arg in overrides:
        if message := unknown_option_message(arg):
            return message
    for arg in overrides:
        match = PLAIN_OVERRIDE.match(arg)
        if not match:
            continue
        try:
            cfg = compose([other for other in overrides if other != arg])
        except Exception:  # noqa: BLE001 - another override is at fault too: leave Hydra's message
            return None
        if message := unknown_override_message(cfg, match.group(1), arg):
            return message
    return None


RUNS_ROOT = Path("results") / "runs"  # where runs go (hydra.run.dir); resume=auto looks here


def override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def resume_arguments(args: list[str]) -> list[str]:
    """``resume=<run folder>`` (or ``resume=auto``: the run below results/runs/ whose latest valid
    checkpoint is the newest) -> the run's own overrides (from its checkpoint's manifest), then the
    other arguments given now (a key given again replaces the saved one; the run then refuses it
    unless ``resume_allow`` lists it), then ``resume=<folder>`` and ``hydra.run.dir=<folder>``.
    Other arguments pass through unchanged."""
    given = [arg for arg in args if override_key(arg) == "resume"]
    if not given:
        return args
    from rlbench.training.checkpoint import CheckpointError, checkpoint_home, find_latest_run, latest_checkpoint

    if any(arg in ("-m", "--multirun") for arg in args):
        fail("resume= continues one run; a sweep (-m) relaunched skips its finished runs and reruns the others")
    value = given[-1].split("=", 1)[1]
    try:
        folder = (find_latest_run(RUNS_ROOT) if value == "auto" else Path(value)).resolve()
        saved = latest_checkpoint(checkpoint_home(folder)).manifest.get("overrides", [])  # a swarm: actor 0's
    except CheckpointError as err:
        fail(str(err))
    others = [arg for arg in args if override_key(arg) not in ("resume", "hydra.run.dir")]
    replaced = {override_key(arg) for arg in others} | {"resume", "resume_allow"}
    kept = [arg for arg in saved if override_key(arg) not in replaced]
    return [*kept, *others, f"resume={folder}", f"hydra.run.dir={folder}"]


def main() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):  # rlbench's own help; Hydra's: --hydra-help
        from rlbench.listing import help_lines

        print("\n".join(help_lines()))
        return
    sys.argv[1:] = resume_arguments(sys.argv[1:])
    if not any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):  # a sweep lists its invalid points
        for arg in sys.argv[1:]:
            if message := unknown_option_message(arg):
                fail(message)
    check_plain_overrides(sys.argv[1:])
    app()


if __name__ == "__main__":
    main()

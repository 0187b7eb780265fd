"""The README's figures, regenerated: ``make readme-figures`` (issue 28).

Re-runs what the README shows, then rewrites its generated sections and the result files they come from:

1. **The default job** (``make run``) for seeds 0, 1, 2 through the command line
   (``rlbench logger=files trainer.save_model=false seed=<s>``), one after the other. Its measured numbers go to
   ``results/default_job.json`` (with the commit and the date they were measured at), rendered as
   ``results/default_job.md`` and as the README section between ``<!-- BEGIN GENERATED: default-job -->`` and
   its END line (the markers of docs/gen_tables.py). Besides pass@1 before and after it records what the gain consists of: the
   share of samples cut off by the 16-token budget and the accuracy on the answers that finished (the
   ``finished_share`` and ``finished_accuracy`` columns of each run's ``eval/passk.csv``).
2. **The comparison example**: the sweep of :data:`SWEEP_COMMAND` (3 algorithms × 2 seeds on arith with
   SmolLM2, a few steps each, plus one misspelt algorithm that is refused up front), then ``rlbench-compare``;
   its folder becomes ``results/compare/example`` (with ``stamp.json``) and its table the README section
   ``comparison``.

Every sentence of a generated section that states a number is written from the measured numbers (e.g.
"every seed improves ..." becomes "seed 1 does not improve ..." when that is what was measured), so a
section cannot drift from its data; ``tests/test_readme_figures.py`` checks that the README equals what
:func:`render_readme` makes of the committed result files, so a hand edit or a stale table fails.

    python bench/readme_figures.py                 # everything (~14 min on an idle 2-core CPU machine)
    python bench/readme_figures.py --only default_job
    python bench/readme_figures.py --collect --default-runs DIR --sweep DIR   # from finished runs, no new runs
    python bench/readme_figures.py --render        # rewrite the README from the committed result files
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEFAULT_JOB_JSON = ROOT / "results" / "default_job.json"
DEFAULT_JOB_MD = ROOT / "results" / "default_job.md"
EXAMPLE = ROOT / "results" / "compare" / "example"
STAMP_FILE = "stamp.json"
WORK = ROOT / "results" / "runs" / "readme_figures"  # git-ignored: the runs themselves

SEEDS = (0, 1, 2)
DEFAULT_JOB_OVERRIDES = ("logger=files", "trainer.save_model=false")
SWEEP_SETTINGS = ("trainer.steps=4", "eval.before_training=false", "trainer.save_model=false", "logger=files")
SWEEP_COMMAND = ("rlbench -m algorithm=grpo,rloo,dr_grpo,dr-grpo seed=0,1 " + " ".join(SWEEP_SETTINGS)
                 + " hydra.sweep.dir=results/multirun/example")
SWEEP_RUNS = 6  # the valid points: 3 algorithms x 2 seeds
BASELINE = "grpo"
COMPARE_COMMAND = f"rlbench-compare results/multirun/example --baseline {BASELINE}  # writes a new results/compare/<time> (make readme-figures: results/compare/example)"
# The paths whose contents change what a run computes: runs measured at two commits that differ only
# elsewhere (docs, tests, the comparison's rendering) measured the same code.
RUN_CODE = ("rlbench", "conf", "hydra_plugins", "pyproject.toml", ":(exclude)rlbench/analysis")



def _gen_tables():
    """docs/gen_tables.py, whose ``replace_region`` rewrites a page's ``<!-- BEGIN/END GENERATED: name -->`` region."""
    spec = importlib.util.spec_from_file_location("gen_tables", ROOT / "docs" / "gen_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StaleFigure(RuntimeError):
    """The README (or a result file) does not say what was measured."""


# --------------------------------------------------------------------------- running


def run_cli(args: Sequence[str], log: Path, env: Mapping[str, str], accept: Sequence[int] = (0,)) -> None:
    """One command-line run, its output to ``log``; another exit status than ``accept`` stops
    everything with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"readme-figures: {' '.join(args)}  (log: {log.relative_to(ROOT)})", flush=True)
    with open(log, "w") as out:
        code = subprocess.run(args, check=False, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code not in accept:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"readme-figures: {' '.join(args)} exited {code}; the end of {log}:\n{tail}")


def run_environment() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def executable(name: str) -> str:
    """``name`` beside the running Python (the project's venv), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def require_committed_code() -> None:
    """Measuring uncommitted code would stamp the numbers with a commit that did not produce them."""
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *RUN_CODE], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    if dirty:
        raise SystemExit("readme-figures: commit these first (the figures are stamped with the commit):\n" + dirty)


def run_default_job(folder: Path, env: Mapping[str, str]) -> Path:
    for seed in SEEDS:
        out = folder / f"seed{seed}"
        run_cli([executable("rlbench"), *DEFAULT_JOB_OVERRIDES, f"seed={seed}", f"hydra.run.dir={out}"],
                folder / f"seed{seed}.log", env)
    return folder


def run_sweep(folder: Path, env: Mapping[str, str]) -> Path:
    args = SWEEP_COMMAND.split()
    args = [executable("rlbench"), *args[1:-1], f"hydra.sweep.dir={folder}"]
    run_cli(args, folder.parent / "sweep.log", env, accept=(0, 1))  # 1: the misspelt point, refused as intended
    done = sum(finished(p.parent) for p in folder.glob("*/summary.json"))
    if done != SWEEP_RUNS:
        raise SystemExit(f"readme-figures: {done} of the sweep's {SWEEP_RUNS} runs finished; see {folder.parent / 'sweep.log'}")
    return folder


# --------------------------------------------------------------------------- collecting


def commit_of(summaries: Sequence[Mapping]) -> str:
    """The commit the runs measured (their summary.json ``git_commit``); runs at several commits are
    accepted only when those commits do not differ in :data:`RUN_CODE`."""
    commits = list(dict.fromkeys(s.get("git_commit", "unknown") for s in summaries))
    if "unknown" in commits:
        raise StaleFigure("a run does not record its commit (summary.json git_commit); rerun from a git checkout")
    for other in commits[1:]:
        diff = subprocess.run(["git", "diff", "--stat", commits[0], other, "--", *RUN_CODE], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        if diff:
            raise StaleFigure(f"the runs measured different code ({commits[0][:7]} and {other[:7]}):\n{diff}")
    return commits[0]


def read_summary(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    if summary.get("status", "finished") != "finished":
        raise StaleFigure(f"{run}: the run did not finish (status {summary.get('status')})")
    return summary


def phase_numbers(passk: pd.DataFrame, phase: str) -> dict[str, float]:
    """pass@1, the share of samples that finished within the budget and the accuracy of those, of the
    run's one benchmark in ``phase``."""
    rows = passk[(passk["phase"] == phase) & (passk["k"] == 1) & ~passk["benchmark"].astype(str).str.startswith("macro")]
    if len(rows) != 1:
        raise StaleFigure(f"expected one benchmark in phase {phase}, found {list(rows['benchmark'])}")
    row = rows.iloc[0]
    for column in ("finished_share", "finished_accuracy"):
        if column not in row:
            raise StaleFigure(f"eval/passk.csv has no {column} column: the run predates it; rerun")
    numbers = {"pass_at_1": row["pass_at_k"], "finished_share": row["finished_share"],
               "finished_accuracy": row["finished_accuracy"]}  # NaN (no sample finished) -> null in the JSON
    return {"benchmark": str(row["benchmark"]), **{k: None if pd.isna(v) else float(v) for k, v in numbers.items()}}


def setting_of(config: Mapping) -> dict:
    """What the default job ran, from its composed config (so the prose says what ran)."""
    trainer, rollout, evaluation = config["trainer"], config["rollout"], config["eval"]
    bench = next(iter(evaluation["benchmarks"].values()))
    return {
        "algorithm": config["algorithm"]["name"], "model": config["model"]["hub_id"] or config["model"]["name"],
        "dataset": config["dataset"]["name"], "level": config["dataset"].get("arith", {}).get("level"),
        "steps": trainer["steps"], "prompts_per_step": trainer["prompts_per_step"], "samples": rollout["n"],
        "max_new_tokens": rollout["max_new_tokens"], "temperature": rollout["temperature"], "lr": trainer["lr"],
        "max_grad_norm": trainer["max_grad_norm"], "kl_coef": config["algorithm"]["kl"]["coef"],
        "eval_problems": bench.get("arith", {}).get("test_size"), "eval_n": evaluation["n"],
        "eval_temperature": evaluation["temperature"], "eval_k": list(evaluation["k"]),
    }


def finished(run: Path) -> bool:
    path = run / "summary.json"
    return path.exists() and json.loads(path.read_text()).get("status", "finished") == "finished"


def collect_default_job(folder: Path, note: str = "", allow_missing: bool = False) -> dict:
    """results/default_job.json's content from the finished runs under ``folder`` (seed<s>/). The machine
    line reads this process's environment, which the runs inherit (``note``: anything to add, such as
    other jobs sharing the machine). ``allow_missing``: collect the seeds that finished (at least
    one), and the section names the others as not measured."""
    measured = [seed for seed in SEEDS if finished(folder / f"seed{seed}")] if allow_missing else list(SEEDS)
    if not measured:
        raise StaleFigure(f"no finished default-job run under {folder}")
    runs = [folder / f"seed{seed}" for seed in measured]
    summaries = [read_summary(run) for run in runs]
    seeds = []
    for seed, run, summary in zip(measured, runs, summaries):
        passk = pd.read_csv(run / "eval" / "passk.csv")
        seeds.append({"seed": seed, "before": phase_numbers(passk, "before"), "after": phase_numbers(passk, "after"),
                      "wall_seconds": round(float(summary["wall_seconds"]), 1)})
    config = yaml.safe_load((runs[0] / "config.yaml").read_text())
    day = dt.datetime.fromtimestamp(max((r / "summary.json").stat().st_mtime for r in runs), dt.timezone.utc)
    return {
        "commit": commit_of(summaries),
        "date": day.date().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
                   f"device {summaries[0].get('device', '?')}, torch {summaries[0].get('versions', {}).get('torch', '?')}"
                   + (f"; {note}" if note else ""),
        "command": "rlbench " + " ".join(DEFAULT_JOB_OVERRIDES) + " seed=<s>",
        "setting": setting_of(config),
        "seeds": seeds,
    }


def collect_comparison(sweep: Path, out: Path, allow_missing: bool = False) -> None:
    """rlbench-compare over the sweep into a fresh folder, which then replaces ``out`` (with stamp.json).
    ``allow_missing``: compare the runs that finished (rlbench-compare leaves the others out)."""
    summaries = [read_summary(p.parent) for p in sorted(sweep.glob("*/summary.json"))
                 if not allow_missing or finished(p.parent)]
    if not summaries:
        raise StaleFigure(f"no finished runs under {sweep}")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        fresh = Path(tmp) / "example"
        code = subprocess.run([executable("rlbench-compare"), str(sweep), "--baseline", BASELINE, "--out", str(fresh)],
                              check=False, cwd=ROOT, env=run_environment(), capture_output=True, text=True)
        if code.returncode != 0:
            raise SystemExit(f"readme-figures: rlbench-compare failed:\n{code.stderr[-3000:]}")
        measured = dt.datetime.fromtimestamp(max(p.stat().st_mtime for p in sweep.glob("*/summary.json")), dt.timezone.utc)
        stamp = {"commit": commit_of(summaries), "date": measured.date().isoformat(), "runs": len(summaries),
                 "runs_planned": SWEEP_RUNS,
                 "commands": [SWEEP_COMMAND, COMPARE_COMMAND]}
        (fresh / STAMP_FILE).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        fresh.rename(out)


# --------------------------------------------------------------------------- rendering


def short(commit: str) -> str:
    return commit[:7]


def number(value: float | None) -> float:
    """A measured number from the JSON: null (nothing to measure, e.g. no sample finished) is NaN."""
    return math.nan if value is None else float(value)


def cut_off_accuracy(phase: Mapping[str, float]) -> float:
    """The accuracy of the cut-off samples (their last number is graded), from pass@1 = s·a_f + (1-s)·a_c;
    NaN when every sample finished."""
    s = number(phase["finished_share"])
    a_f = number(phase["finished_accuracy"]) if s > 0 else 0.0
    return (number(phase["pass_at_1"]) - s * a_f) / (1 - s) if s < 1 else math.nan


def gain_parts(before: Mapping[str, float], after: Mapping[str, float]) -> tuple[float, float]:
    """(gain in pass@1, the part of it that finishing more often explains). pass@1 is the accuracy
    of all samples, s·a_f + (1-s)·a_c (s: finished share, a_f / a_c: accuracy of finished / cut-off
    samples); finishing alone would have moved s from s₀ to s₁ at the base model's a_f and a_c, a gain
    of (s₁ - s₀)·(a_f₀ - a_c₀). The rest is answering right more often."""
    s0, s1 = number(before["finished_share"]), number(after["finished_share"])
    a_f0 = number(before["finished_accuracy"]) if s0 > 0 else 0.0
    a_c0 = cut_off_accuracy(before) if s0 < 1 else 0.0
    return number(after["pass_at_1"]) - number(before["pass_at_1"]), (s1 - s0) * (a_f0 - a_c0)


def _mean(values: Sequence[float | None]) -> float:
    """The mean of the defined values (NaN when none is)."""
    defined = [number(v) for v in values if not math.isnan(number(v))]
    return sum(defined) / len(defined) if defined else math.nan


def _cut_off(finished_share: float) -> str:
    return f"{100 * (1 - finished_share):.0f}%"


def _accuracy(value: float | None) -> str:
    return "—" if math.isnan(number(value)) else f"{number(value):.2f}"


def default_job_table(data: Mapping) -> str:
    lines = ["| seed | pass@1 before | after | cut off before | after | finished right before | after | wall time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in data["seeds"]:
        b, a = s["before"], s["after"]
        lines.append(f"| {s['seed']} | {b['pass_at_1']:.3f} | {a['pass_at_1']:.3f} | {_cut_off(b['finished_share'])} | "
                     f"{_cut_off(a['finished_share'])} | {_accuracy(b['finished_accuracy'])} | "
                     f"{_accuracy(a['finished_accuracy'])} | {s['wall_seconds'] / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def improvement_claim(data: Mapping) -> str:
    """"Every seed improves ..." or the seeds that do not, from the numbers."""
    gains = {s["seed"]: s["after"]["pass_at_1"] - s["before"]["pass_at_1"] for s in data["seeds"]}
    worse = [seed for seed, gain in gains.items() if gain <= 0]
    if not worse and len(gains) == 1:
        seed, gain = next(iter(gains.items()))
        return f"Seed {seed} improves pass@1 by {gain:.2f}."
    if not worse:
        low, high = f"{min(gains.values()):.2f}", f"{max(gains.values()):.2f}"
        return f"Every seed improves pass@1, by {low}." if low == high else f"Every seed improves pass@1, by {low} to {high}."
    listed = ", ".join(f"seed {seed} ({gains[seed]:+.3f})" for seed in worse)
    return f"Not every seed improves pass@1: {listed} does not."


def what_the_gain_is(data: Mapping) -> str:
    """The gain split into finishing within the budget and answering right, from the numbers."""
    setting, seeds = data["setting"], data["seeds"]
    parts = [gain_parts(s["before"], s["after"]) for s in seeds]
    gain, finishing = _mean([g for g, _ in parts]), _mean([f for _, f in parts])
    cut_before = _mean([1 - s["before"]["finished_share"] for s in seeds])
    cut_after = _mean([1 - s["after"]["finished_share"] for s in seeds])
    acc_before = _mean([s["before"]["finished_accuracy"] for s in seeds])
    acc_after = _mean([s["after"]["finished_accuracy"] for s in seeds])
    cut_accuracy = _mean([cut_off_accuracy(s["before"]) for s in seeds])
    mostly = "mostly learning to finish within the budget" if finishing > gain / 2 else "mostly answering right more often"
    return (
        f"Means over the seeds: before training {100 * cut_before:.0f}% of the samples are cut off at "
        f"{setting['max_new_tokens']} tokens (graded on the last number reached: {_accuracy(cut_accuracy)} right, "
        f"against {_accuracy(acc_before)} of finished answers), after training {100 * cut_after:.0f}%, with "
        f"{_accuracy(acc_after)} of finished answers right. Finishing more often at the base model's accuracies "
        f"accounts for {finishing:.2f} of the {gain:.2f} gain: the gain is {mostly}."
    )


def missing_seeds_note(data: Mapping) -> str:
    """'' when every seed of :data:`SEEDS` was measured, else the sentence that says which were not."""
    missing = [seed for seed in SEEDS if seed not in {s["seed"] for s in data["seeds"]}]
    if not missing:
        return ""
    listed = ", ".join(str(seed) for seed in missing)
    return (f" Seed{'s' if len(missing) > 1 else ''} {listed} {'were' if len(missing) > 1 else 'was'} not measured "
            "in the time this measurement had; `make readme-figures` measures all of them.")


def default_job_section(data: Mapping, detail: bool = False) -> str:
    """The README's section (``detail``: results/default_job.md's, with why level 1 and the JSON's link)."""
    s = data["setting"]
    ks = ", ".join(str(k) for k in s["eval_k"])
    kl = "no KL" if not s["kl_coef"] else f"KL coefficient {s['kl_coef']}"
    return (
        f"{s['algorithm'].upper() if s['algorithm'] == 'grpo' else s['algorithm']} on {s['model'].split('/')[-1]} with "
        f"the arithmetic task at level {s['level']} (single-digit sums, `a + b`): {s['steps']} steps of "
        f"{s['prompts_per_step']} prompts × {s['samples']} samples, {s['max_new_tokens']} new tokens, temperature "
        f"{s['temperature']}, lr {s['lr']:g}, gradient clipping {s['max_grad_norm']}, {kl}. It is evaluated before "
        f"and after training on {s['eval_problems']} held-out level-{s['level']} expressions, each sampled "
        f"{s['eval_n']} times at temperature {s['eval_temperature']}, with k ∈ {{{ks}}}."
        + (" Level 1 was chosen because the base model's pass@1 there "
           f"({_mean([x['before']['pass_at_1'] for x in data['seeds']]):.2f}, the mean over the seeds below) gives "
           "groups with both right and wrong answers, which GRPO needs for a learning signal (at level 2, a ± b up "
           "to 99, a 32-sample check of the base model found 0.03; `dataset.arith.level=2` is there for longer "
           "runs)." if detail else "")
        + f"\n\nMeasured at commit {short(data['commit'])} on {data['date']} ({data['machine']}) by "
        f"`make readme-figures`, each seed by `{data['command']}` "
        + ("([default_job.json](default_job.json))" if detail else "([results/default_job.md](results/default_job.md))")
        + "; cut off: samples that reached the token budget without finishing; finished right: the share of "
        "the finished samples graded right:\n\n"
        + default_job_table(data) + "\n" + improvement_claim(data) + " " + what_the_gain_is(data)
        + missing_seeds_note(data) + "\n"
    )


def default_job_markdown(data: Mapping) -> str:
    """results/default_job.md: the section, with the per-seed detail a README leaves out."""
    return (
        f"# The default job (`make run`), seed{'s' if len(data['seeds']) > 1 else ''} "
        f"{', '.join(str(s['seed']) for s in data['seeds'])}\n\n"
        "Generated by `make readme-figures` (bench/readme_figures.py) from [default_job.json](default_job.json); "
        "do not edit by hand.\n\n" + default_job_section(data, detail=True)
        + "\npass@1 is the unbiased estimate from the samples of each problem (`eval/passk.csv` in each run "
        "folder has its 95% interval and the other k); the finished share and the accuracy of finished answers "
        "are its `finished_share` and `finished_accuracy` columns. Wall time includes model loading and both "
        "evaluations.\n"
    )


def comparison_section(example: Path) -> str:
    stamp = json.loads((example / STAMP_FILE).read_text())
    table = (example / "table.md").read_text()
    steps = re.search(r"trainer\.steps=(\d+)", stamp["commands"][0]).group(1)
    runs = pd.read_csv(example / "runs.csv")
    seeds_of = runs.groupby("group", sort=False)["seed"].apply(lambda s: ", ".join(str(x) for x in sorted(s)))
    if seeds_of.nunique() == 1:  # every method has the same seeds
        which = f"{', '.join(seeds_of.index[:-1])} and {seeds_of.index[-1]} × seeds {seeds_of.iloc[0]}"
    else:
        which = "; ".join(f"{group} × seeds {seeds}" for group, seeds in seeds_of.items())
    figures = [name for name in ("passk_curves.png", "training_curves.png") if (example / name).exists()]
    titles = {"passk_curves.png": "pass@k against k", "training_curves.png": "training curves"}
    links = "\n\n".join(f"![{titles[name]}](results/compare/example/{name})" for name in figures)
    return (
        f"One sweep, one command: {which} ({len(runs)} runs), the default job cut to {steps} steps, each evaluated "
        "after training, so pass@k and maj@k are arithmetic accuracy; a fourth, misspelt algorithm (`dr-grpo`) is "
        "refused before the first run starts ([results/compare/example](results/compare/example), "
        "[docs/compare.md](docs/compare.md))" + (
            f"; {stamp['runs_planned'] - len(runs)} of its {stamp['runs_planned']} runs did not finish in the time this "
            "measurement had (`make readme-figures` runs them all)" if len(runs) < stamp.get("runs_planned", 0) else "")
        + ":\n\n"
        "```bash\n" + stamp["commands"][0].replace(" hydra.sweep.dir", " \\\n  hydra.sweep.dir") + "\n"
        + stamp["commands"][1] + "\n```\n\n"
        f"Measured at commit {short(stamp['commit'])} on {stamp['date']} by `make readme-figures`. Cells: mean "
        "over seeds ± half the 95% interval; Δ: paired difference to the baseline [95% interval], sign-flip p; "
        "bold: a Δ whose interval excludes 0.\n\n" + table + "\n" + links + "\n"
    )


SECTIONS = {"default-job": lambda: default_job_section(json.loads(DEFAULT_JOB_JSON.read_text())),
            "comparison": lambda: comparison_section(EXAMPLE)}


def render_readme(text: str) -> str:
    """``text`` (the README) with every generated section (``<!-- BEGIN GENERATED: default-job -->`` to its
    END line, and ``comparison``) rewritten from the committed result files; ValueError when one is missing."""
    replace_region = _gen_tables().replace_region
    for name in SECTIONS:  # every marker first: a missing one is the error, before any result file is read
        replace_region(text, name, "")
    for name, body in SECTIONS.items():
        text = replace_region(text, name, body())
    return text


def write_results(data: Mapping) -> None:
    DEFAULT_JOB_JSON.write_text(json.dumps(data, indent=1) + "\n")
    DEFAULT_JOB_MD.write_text(default_job_markdown(data))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("default_job", "comparison"), default=None)
    parser.add_argument("--collect", action="store_true", help="no new runs: collect from --default-runs / --sweep")
    parser.add_argument("--default-runs", type=Path, default=None, help="a folder with seed0/, seed1/, seed2/")
    parser.add_argument("--sweep", type=Path, default=None, help="the comparison sweep's folder")
    parser.add_argument("--render", action="store_true", help="only rewrite README.md from the committed result files")
    parser.add_argument("--note", default="", help="added to the machine line, e.g. 'shared with other jobs'")
    parser.add_argument("--allow-missing", action="store_true",
                        help="with --collect: use the default-job seeds and sweep runs that finished, say which did not")
    args = parser.parse_args(argv)
    todo = [args.only] if args.only else ["default_job", "comparison"]
    if not args.render:
        if not args.collect:
            require_committed_code()
            folder = WORK / dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H-%M-%S")
            env = run_environment()
            if "default_job" in todo:
                args.default_runs = run_default_job(folder / "default_job", env)
            if "comparison" in todo:
                args.sweep = run_sweep(folder / "example", env)
        if "default_job" in todo:
            write_results(collect_default_job(args.default_runs, args.note, args.allow_missing))
        if "comparison" in todo:
            collect_comparison(args.sweep, EXAMPLE, args.allow_missing)
    README.write_text(render_readme(README.read_text()))
    print("readme-figures: README.md, results/default_job.{json,md} and results/compare/example are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

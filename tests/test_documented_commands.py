"""Every command in README.md and docs/*.md, run as written (issue 28).

The commands are the lines of the ```bash blocks of each page (a line ending in ``\\`` continues on the
next; a ``#`` comment is dropped). Each page's commands run in order in one fresh working directory, as a
reader following the page would run them: a later command may use what an earlier one made (a saved
policy, a run to resume, a sweep to compare). The text is never edited; what changes is said here, and
``python tests/test_documented_commands.py`` prints every command beside what runs:

- **the smoke suffix** (:data:`SMOKE_SUFFIX`): a command that starts a run and names no ``experiment=``
  gets ``experiment=smoke`` appended (tiny random model, 2 steps, a few evaluation problems), and one
  that names no logger gets ``logger=files`` (:data:`FILES_LOGGER`);
- **the tiny model**: a command that picks another model (``model=smollm2_135m``, a Qwen preset) gets
  ``model=tiny`` appended; the last value of a key wins on Hydra's command line;
- **caps** (:data:`CAPS`): a value above its cap (``rollout.max_new_tokens=1024``, ``trainer.steps=100``)
  gets ``key=<cap>`` appended;
- **placeholders** (:data:`PLACEHOLDERS`): ``results/multirun/<time>`` is the newest sweep folder,
  ``/data/my.jsonl`` and ``/abs/path/*.jsonl`` are small files this test writes, as are docs/preference.md's
  offline files (``prefs.jsonl``, ``prefs.parquet``, ``ranked.jsonl``);
- **set-up** (:data:`PAGE_SETUP`): what a page assumes from an earlier page (a saved policy) runs first;
- **skips** (:data:`SKIPS`): commands that need what a test machine has not (a Slurm cluster, GPUs, the
  Hub, a credential, the test suite itself), each with its reason; commands that read the benchmark data
  skip without it;
- **refusals** (:data:`REFUSALS`): a command the page says is refused must fail with that message (a sweep
  with an invalid point runs the others and exits 1).

Commands that start no run (``--help``, ``--cfg``, ``--info``, ``-sc``), ``resume=`` (it continues a run
that had the suffix) and ``rlbench-compare`` run exactly as written. Every other command must exit 0
without a traceback; one that starts a single run must end its standard output with its ``results:`` line, whose folder exists
(``mode=generate``: its ``traces:`` or ``pool:`` line); :data:`SMOKE_EXTRA` lists the few overrides a command needs on the
smoke experiment's smaller groups, each with its reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, _data_available

pytestmark = pytest.mark.slow

PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))

SMOKE_SUFFIX = ("experiment=smoke",)
# Result files only, for a run that names no logger: wandb's offline start and finish cost ~2 s a run, and
# tests/test_wandb_logging.py covers that logger.
FILES_LOGGER = "logger=files"
TINY_MODELS = ("tiny", "checkpoint")  # model options the suffix keeps: the tiny model, a saved policy
CAPS = {
    "trainer.steps": 4,
    "rollout.max_new_tokens": 16,
    "eval.max_new_tokens": 16,
    "eval.limit": 4,
    "eval.n": 4,
    "rollout.n": 16,
}

# (pattern, reason): a command matching the pattern (re.search) is not run.
SKIPS = (
    (r"^make (run|test)\b", ("make test is the suite itself (CI runs it); make run is `rlbench`, run with the "
                             "smoke suffix in docs/running.md")),
    (r"^export WANDB_API_KEY", "a credential"),
    (r"\b(scontrol|srun|sbatch)\b|hydra/launcher=slurm", "needs a Slurm cluster"),
    (r"device=cuda|rollout\.engine=vllm|--nproc_per_node [3-9]", ("needs GPUs (bench/gpu_check.sh checks these "
                                                                  "paths on the device tool's machine, docs/scaling.md)")),
    (r"model=hub\b", "downloads a model from the Hugging Face Hub"),
)

# A command that reads benchmark files (every dataset and suite but the generated arith and flaw_steps and the custom
# or own-JSONL ones, and every run of a paper preset) skips when the data folder is missing, as the tests
# that read it do (Command.reads_data).
NEEDS_DATA = r"\b(dataset|eval)=(?!arith\b|custom\b|jsonl\b|flaw_steps\b)\w+"

# Commands the documentation says are refused, in whole or in part: (exact command, text the output must
# contain); each must exit non-zero. A sweep with an invalid point runs the valid ones and exits 1.
REFUSALS = {
    "rlbench paper=dapo": "Choose a smaller model",  # the fit check, before anything loads
    "rlbench -m experiment=smoke trainer.micro_batch_size=3,2": "1 to run, 1 invalid",
    "rlbench -m algorithm=grpo,rloo,dr_grpo,dr-grpo seed=0,1 trainer.steps=4 eval.before_training=false "
    "trainer.save_model=false logger=files hydra.sweep.dir=results/multirun/example": "6 to run, 2 invalid",
}
# Refusals that run as written: the smoke suffix would make them fit.
REFUSED_AS_WRITTEN = ("rlbench paper=dapo",)

# Overrides a command needs under the smoke suffix, with the reason: (exact command, overrides appended).
SMOKE_EXTRA = {
    # 0.25 of the smoke experiment's 4 responses keeps 1, which D3S refuses (a variance needs 2); the
    # default rollout.n of 8 keeps 2
    "rlbench algorithm=d3s algorithm.downsampling.samples=0.25 algorithm.downsampling.schedule=cosine": ("rollout.n=8",),
    # the smoke experiment's 8 new tokens leave nothing to generate after the 2 revealed segments of 4
    # tokens (the page's next command sets 16, as this does)
    "rlbench rollout=mcts_prefix": ("rollout.max_new_tokens=16",),
}

# What a page takes from an earlier page: commands run first, in the page's working directory.
PAGE_SETUP = {
    "docs/evaluation.md": ("rlbench experiment=smoke",),  # the policy results/latest/policy (make run saves one)
    "docs/papers.md": ("rlbench -m paper=dapo experiment=smoke seed=0,1",),  # the sweep results/multirun/<time>
}

OWN_ROWS = ('{"question": "What is 2 + 3?", "answer": "5"}\n'
            '{"question": "What is 4 + 1?", "answer": "5"}\n'
            '{"question": "What is 6 + 2?", "answer": "8"}\n'
            '{"question": "What is 1 + 1?", "answer": "2"}\n')


def _write_own_data(workdir: Path) -> None:
    """The files the placeholders stand for: a custom benchmark (question/solution) and a training set."""
    own = workdir / "own"
    own.mkdir(exist_ok=True)
    (own / "train.jsonl").write_text(OWN_ROWS)
    (own / "test.jsonl").write_text(OWN_ROWS)
    (workdir / "my.jsonl").write_text(OWN_ROWS.replace('"answer"', '"solution"'))
    # docs/preference.md's offline files: pairs (JSONL and Parquet) and rankings of the same problems
    pairs = [{"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in ((2, 3), (4, 1), (6, 2))]
    (workdir / "prefs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(pairs), workdir / "prefs.parquet")
    (workdir / "ranked.jsonl").write_text("".join(
        json.dumps({"prompt": row["prompt"], "ranking": [row["chosen"], row["rejected"], "0"]}) + "\n" for row in pairs))


def _newest_sweep(workdir: Path) -> str:
    sweeps = sorted((workdir / "results" / "multirun").glob("*"), key=lambda p: p.stat().st_mtime)
    if not sweeps:
        raise AssertionError("results/multirun/<time> names a sweep folder, but no sweep ran before this command")
    return str(sweeps[-1].relative_to(workdir))


PLACEHOLDERS = {
    "results/multirun/<time>": _newest_sweep,
    "/data/my.jsonl": lambda workdir: str(workdir / "my.jsonl"),
    "/abs/path/": lambda workdir: str(workdir / "own") + "/",
}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # as written, without its comment

    @cached_property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    def skip_reason(self, data: bool) -> str | None:
        for pattern, reason in SKIPS:
            if re.search(pattern, self.text):
                return reason
        if not data and self.reads_data():
            return "benchmark data not found (set RLBENCH_DATA_DIR)"
        return None

    def reads_data(self) -> bool:
        """Whether the command reads benchmark files: it names a dataset or suite that is not generated, or
        runs a paper preset (each trains on its paper's data) or compares runs with one."""
        if re.search(NEEDS_DATA, self.text):
            return True
        paper = re.search(r"\bpaper=|--paper\b", self.text)
        return bool(paper) and (self.starts_run() or self.text in REFUSALS or self.text.startswith("rlbench-compare"))

    def starts_run(self) -> bool:
        words = self.words
        program = next((w for w in words if "=" not in w or w.startswith("-")), "")
        if program not in ("rlbench", "torchrun"):
            return False
        return not any(w in ("--help", "--hydra-help", "--cfg", "--info", "-sc") or w.startswith("resume=")
                       for w in words)

    def single_run(self) -> bool:
        words = self.words
        return self.starts_run() and "-m" not in words and "--multirun" not in words and words[0] == "rlbench"

    def as_run(self, workdir: Path) -> str:
        """The command line that runs: placeholders filled, then the smoke suffix, the tiny model and caps."""
        text = self.text
        for placeholder, value in PLACEHOLDERS.items():
            if placeholder in text:
                text = text.replace(placeholder, value(workdir))
        if not self.starts_run() or self.text in REFUSED_AS_WRITTEN:
            return text
        words = self.words
        extra = [] if any(w.startswith("experiment=") for w in words) else list(SMOKE_SUFFIX)
        if not any(w.startswith(("logger=", "logger.")) for w in words):
            extra.append(FILES_LOGGER)
        models = [w.split("=", 1)[1] for w in words if w.startswith("model=")]
        if models and models[-1] not in TINY_MODELS:
            extra.append("model=tiny")
        for word in words:
            key, _, value = word.partition("=")
            if key in CAPS and value.isdigit() and int(value) > CAPS[key]:
                extra.append(f"{key}={CAPS[key]}")
        return " ".join([text, *extra, *SMOKE_EXTRA.get(self.text, ())])


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def page_commands(page: str) -> list[Command]:
    """The commands of a page's ```bash blocks, continuation lines joined, comments dropped."""
    commands: list[Command] = []
    in_block = False
    pending, start = "", 0
    for number, line in enumerate((ROOT / page).read_text().splitlines(), start=1):
        if line.startswith("```"):
            in_block = line.strip() == "```bash" if not in_block else False
            continue
        if not in_block:
            continue
        text = _strip_comment(line.strip())
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        text = (pending + text).strip()
        pending = ""
        if text:
            commands.append(Command(page, start, text))
    return commands


def unlabelled_command_blocks(page: str) -> list[int]:
    """Lines of fenced blocks without a language that hold a command: label them ```bash so they are tested."""
    lines = (ROOT / page).read_text().splitlines()
    found, fence, language = [], None, ""
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            if fence is None:
                fence, language = number, line[3:].strip()
            else:
                fence = None
            continue
        if fence is not None and language == "" and re.match(r"(rlbench|rlbench-compare|torchrun|make) ", line):
            found.append(fence)
    return sorted(set(found))


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env.pop("RLBENCH_VERBOSE", None)
    return env


def _run(command: str, workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], check=False, cwd=workdir, env=_environment(), capture_output=True, text=True,
                          timeout=900)


def _problem(command: Command, result: subprocess.CompletedProcess, workdir: Path) -> str | None:
    """What is wrong with a finished command, or None."""
    output = result.stdout + result.stderr
    if command.text in REFUSALS:
        wanted = REFUSALS[command.text]
        if result.returncode == 0 or wanted not in output:
            return f"should be refused with '{wanted}' (exit {result.returncode})"
        return None
    if result.returncode != 0:
        return f"exit {result.returncode}"
    if "Traceback (most recent call last)" in output:
        return "printed a traceback"
    if command.single_run():
        last = [line for line in result.stdout.splitlines() if line.strip()][-1:]
        if "mode=generate" in command.text:  # graded traces, or RLEP's pool (rollout.replay.pool_save)
            named = last and last[0].startswith("pool: " if "pool_save=" in command.text else "traces: ")
            return None if named else "generate's last line does not name its traces or pool"
        if not last or not last[0].startswith("results: "):
            return "a run's last line is not its results path"
        folder = Path(last[0].removeprefix("results: ").split(" (")[0])
        if not (workdir / folder).is_dir():
            return f"the results folder {folder} does not exist"
    return None


PAGES_WITH_COMMANDS = [page for page in PAGES if page_commands(page)]


def test_commands_are_found():
    """The extraction sees the documented commands (a renamed fence or a broken parser would test nothing)."""
    commands = [c for page in PAGES for c in page_commands(page)]
    assert len(commands) >= 60, len(commands)
    readme = [c.text for c in page_commands("README.md")]
    assert "rlbench experiment=smoke" in readme
    assert any(c.startswith("rlbench -m algorithm=grpo,rloo,dr_grpo,dr-grpo") and "hydra.sweep.dir" in c for c in readme)
    for command in commands:
        assert "#" not in command.text.split("'")[0].split('"')[0], command


def test_the_mechanism():
    """The suffix, the tiny model, caps and placeholders, on commands of the documentation's kinds."""
    workdir = Path("/w")
    run = Command("x", 1, "rlbench model=qwen2_5_0_5b_instruct rollout.max_new_tokens=1024 trainer.steps=3")
    assert run.as_run(workdir) == f"{run.text} experiment=smoke logger=files model=tiny rollout.max_new_tokens=16"
    assert Command("x", 1, "rlbench experiment=smoke").as_run(workdir) == "rlbench experiment=smoke logger=files"
    assert Command("x", 1, "rlbench logger.project=p").as_run(workdir) == "rlbench logger.project=p experiment=smoke"
    assert Command("x", 1, "rlbench --cfg job").as_run(workdir) == "rlbench --cfg job"
    assert Command("x", 1, "rlbench resume=results/runs/a").as_run(workdir) == "rlbench resume=results/runs/a"
    assert Command("x", 1, "rlbench mode=eval model=checkpoint model.path=p").as_run(workdir).endswith(
        "model.path=p experiment=smoke logger=files")
    custom = Command("x", 1, "rlbench mode=eval eval=custom eval.benchmarks.custom.files.test=/data/my.jsonl")
    assert "files.test=/w/my.jsonl" in custom.as_run(workdir)
    assert Command("x", 1, "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m rlbench.cli").starts_run()
    assert Command("x", 1, "rlbench paper=dapo").as_run(workdir) == "rlbench paper=dapo"
    assert Command("x", 1, "make test").skip_reason(data=True)
    assert Command("x", 1, "rlbench eval=all").skip_reason(data=False)
    assert Command("x", 1, "rlbench eval=custom").skip_reason(data=False) is None
    assert Command("x", 1, "rlbench paper=dapo experiment=smoke").skip_reason(data=False)
    assert Command("x", 1, "rlbench paper=dapo --cfg job").skip_reason(data=False) is None
    assert Command("x", 1, "rlbench-compare results/multirun/<time> --paper dapo").skip_reason(data=False)
    assert _strip_comment("rlbench 'a=[#x]' # note") == "rlbench 'a=[#x]'"


@pytest.mark.parametrize("page", PAGES)
def test_no_unlabelled_command_block(page):
    """A fenced block of commands without ```bash would be skipped by the test below."""
    assert unlabelled_command_blocks(page) == [], f"{page}: label these blocks ```bash (lines)"


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS)
def test_documented_commands_run(page, tmp_path):
    data = _data_available()
    _write_own_data(tmp_path)
    failures, skipped, ran = [], [], 0
    setup = [Command(page, 0, text) for text in PAGE_SETUP.get(page, ())]
    for command in [*setup, *page_commands(page)]:
        reason = command.skip_reason(data)
        if reason:
            skipped.append(f"{page}:{command.line} {command.text}: {reason}")
            continue
        run = command.as_run(tmp_path)
        started = time.monotonic()
        result = _run(run, tmp_path)
        ran += 1
        problem = _problem(command, result, tmp_path)
        print(f"{page}:{command.line} [{time.monotonic() - started:.0f} s] {run}" + (f"  FAILED: {problem}" if problem else ""))
        if problem:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            failures.append(f"{page}:{command.line}: {command.text}\n  ran: {run}\n  {problem}\n{tail}")
    print("\n".join(f"skipped {s}" for s in skipped))
    assert not failures, "\n\n".join(failures)
    assert ran or skipped


def main() -> None:
    """Print every documented command beside what the test runs (or why it skips it)."""
    data = _data_available()
    workdir = Path("<workdir>")
    for page in PAGES_WITH_COMMANDS:
        print(f"## {page}")
        setup = [Command(page, 0, text) for text in PAGE_SETUP.get(page, ())]
        for command in [*setup, *page_commands(page)]:
            reason = command.skip_reason(data)
            if reason:
                print(f"  {command.line:4d}  {command.text}\n        skipped: {reason}")
                continue
            try:
                run = command.as_run(workdir)
            except AssertionError:
                run = command.text + "  (placeholder filled at run time)"
            print(f"  {command.line:4d}  {command.text}" + (f"\n        runs: {run}" if run != command.text else ""))


if __name__ == "__main__":
    main()

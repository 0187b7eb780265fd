"""The GPU check (bench/gpu_check.sh, bench/gpu_check.py): its device mode's dry run on a machine without
CUDA (every check skipped for lack of a GPU, the table and the logs written, the bundle's wheels installed
when there and skipped when not), and the wheel list: pins inside pyproject's ranges and the carried
distributions' own requirements, and every distribution rlbench imports on the image, carried, or left
behind with a reason. No network."""

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dry_run(tmp_path: Path, bundle: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, site = tmp_path / "out", tmp_path / "site"
    env = {**os.environ, "OUT_DIR": str(out), "GPU_BUNDLE": str(bundle), "GPU_SITE": str(site), "PY": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, out, site


@no_cuda
def test_device_mode_without_cuda_skips_every_check_and_writes_the_table(tmp_path):
    proc, out, site = dry_run(tmp_path, tmp_path / "no_bundle")
    assert "no wheels in" in proc.stdout and not site.exists()  # nothing to install: said, and went on
    rows = json.loads((out / "gpu_check.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [check.__name__ for check in gpu_check.CHECKS]
    for row in rows:
        assert row["status"] == "skipped", row
        assert "no CUDA GPU" in row["detail"], row
        assert row["step_s"] is row["peak_memory_mib"] is row["max_abs_delta"] is None
    table = (out / "gpu_check.md").read_text()
    for row in rows:
        assert f"| {row['name']} | skipped | - | - | - | no CUDA GPU" in table
    with tarfile.open(out / "logs.tar.gz") as tar:  # a valid archive (no check ran: no log in it)
        assert tar.getnames() == []
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (one module) as pip installs it."""
    folder.mkdir(parents=True)
    wheel = folder / "gpucheckprobe-1.0-py3-none-any.whl"
    info = "gpucheckprobe-1.0.dist-info"
    files = {
        "gpucheckprobe.py": "ANSWER = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheckprobe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(name, text)
    return wheel


@no_cuda
def test_device_mode_installs_the_bundles_wheels_into_its_site_folder(tmp_path):
    bundle = tmp_path / "bundle"
    probe_wheel(bundle / "wheels")
    proc, out, site = dry_run(tmp_path, bundle)
    assert f"installed 1 wheels from {bundle}/wheels into {site}" in proc.stdout
    assert (site / "gpucheckprobe.py").read_text() == "ANSWER = 42\n"
    assert (out / "gpu_check.md").is_file()


def test_the_wheel_pins_fit_pyproject_and_the_carried_distributions_requirements():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    direct = {normalized(r.name): r for r in map(Requirement, pyproject)}
    pins = {normalized(name): version for name, version in gpu_check.WHEELS.items()}
    available = pins.keys() | {normalized(n) for n in gpu_check.IMAGE}
    for name, version in pins.items():
        if name in direct:
            assert direct[name].specifier.contains(version), (name, version, str(direct[name]))
        # what the carried distribution needs on the device's Python 3.12: on the image, or carried in range
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"python_version": "3.12", "extra": ""}):
                continue
            assert normalized(req.name) in available, f"{name} needs {req}: neither on the image nor in WHEELS"
            if normalized(req.name) in pins:
                assert req.specifier.contains(pins[normalized(req.name)]), (name, str(req))


def test_the_pip_commands_fetch_every_pin_for_the_devices_python():
    commands = gpu_check.pip_commands(Path("/dest"), python="py")
    download, *built = commands
    assert download[:4] == ["py", "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(download)
    assert download[download.index("--python-version") + 1] == "3.12"
    assert "manylinux2014_x86_64" in download and download[download.index("-d") + 1] == "/dest"
    asked = [arg for command in commands for arg in command if "==" in arg]
    assert sorted(asked) == sorted(f"{n}=={v}" for n, v in gpu_check.WHEELS.items())
    assert [c[3] for c in built] == ["wheel"] * len(gpu_check.BUILT_FROM_SOURCE)


def top_level_imports(path: Path) -> tuple[set[str], set[str]]:
    """The top-level modules ``path`` imports: (others, modules of its own folder, sys.path[0] there)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    own = {n for n in names if (path.parent / f"{n}.py").is_file()}
    return names - own, own


def test_every_distribution_the_device_checks_import_is_on_the_image_carried_or_left_with_a_reason():
    """rlbench, its Hydra plugin, the check and the gpu-marked tests (with the test modules they import):
    every import outside the standard library comes from a distribution of IMAGE, WHEELS or NOT_CARRIED,
    and every NOT_CARRIED entry is imported somewhere."""
    pending = [*(ROOT / "rlbench").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py"),
               ROOT / "bench" / "gpu_check.py", ROOT / "tests" / "conftest.py", *gpu_check.gpu_marked_test_files()]
    seen, modules = set(), set()
    while pending:
        path = pending.pop()
        if path not in seen:
            seen.add(path)
            others, own = top_level_imports(path)
            modules |= others
            pending += [path.parent / f"{n}.py" for n in own]
    third_party = {m for m in modules - {"rlbench", "hydra_plugins"} - set(sys.stdlib_module_names)
                   if not m.startswith("_")}
    owners = importlib.metadata.packages_distributions()
    distributions = {normalized(d) for m in third_party for d in owners.get(m, [m])}
    known = {normalized(n) for n in (*gpu_check.IMAGE, *gpu_check.WHEELS, *gpu_check.NOT_CARRIED)}
    assert distributions - known == set()
    stale = {normalized(n) for n in gpu_check.NOT_CARRIED} - distributions
    assert stale == set(), f"NOT_CARRIED names distributions nothing here imports: {stale}"


def test_the_cpu_vs_cuda_step_is_reproducible_on_one_device_and_its_tolerance_sees_a_changed_weight():
    """The comparison's machinery on the CPU (the CUDA side runs on the GPU alone): the same weights give the
    same loss and gradients, every parameter gets a gradient, and a weight moved by 0.01 is outside the
    stated tolerance."""
    import copy

    from test_trainer import tiny_lm

    model = tiny_lm(0)
    first, again = gpu_check.loss_and_gradients(model, "cpu"), gpu_check.loss_and_gradients(copy.deepcopy(model), "cpu")
    assert torch.isfinite(first[0]) and torch.equal(first[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
    assert all(g.abs().sum() > 0 for g in first[1])
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.model.layers[0].self_attn.q_proj.weight.add_(0.01)
    changed = gpu_check.loss_and_gradients(moved, "cpu")
    assert not all(torch.allclose(a, b, atol=gpu_check.CPU_CUDA_ATOL, rtol=gpu_check.CPU_CUDA_RTOL)
                   for a, b in zip([first[0], *first[1]], [changed[0], *changed[1]]))

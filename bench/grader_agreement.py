"""Agreement of our math grader with two public graders, on the same samples.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/grader_agreement.py                 # battery samples
    HF_HUB_OFFLINE=1 .venv/bin/python bench/grader_agreement.py \
        --samples results/<run>/eval/samples.jsonl                              # plus model samples

The peers, each used as its authors document it:
  * math-verify (``math_verify.parse`` of the gold ``$ref$`` and of the whole response, then
    ``math_verify.verify(gold, answer)``: its default extraction and normalisation, units included);
  * the PRM800K grader (OpenAI, arXiv:2305.20050; packaged on PyPI as ``mathruler``: its
    ``extract_boxed_content`` on the response, then ``grade_answer(given, ground_truth)``).

Samples: the probe battery (rlbench/reward/probe.py) of MATH-500, GSM8K test, AIME 2024, AMC 2023 and
every ``--math-train-every``-th MATH train answer, each probe put as a response ending in ``\\boxed{}``
(the truth is known: a rendering is right, a wrong answer is wrong); the pairs of the grader table
(tests/test_grader_table.py, its verdicts taken as the truth: the policy and the false positives of
issue 16); and the responses of ``--samples`` files (truth unknown; every disagreement is listed). Writes
results/eval/grader_agreement.md and .json (atomically).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlbench.reward.probe import BATTERY_SOURCES, battery_problems, probes_for  # noqa: E402
from rlbench.utils import atomic_write_json, atomic_write_text  # noqa: E402

PEERS = ("math_verify", "prm800k")
PEER_TIMEOUT_S = 5
EXAMPLES_KEPT = 20  # per disagreement class, in the .json (the .md shows 3)


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _bounded(fn, *args) -> bool | None:
    """fn(*args) as a bool; None when it raised or ran past PEER_TIMEOUT_S (main thread only)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PEER_TIMEOUT_S)
    try:
        return bool(fn(*args))
    except (_Timeout, Exception):  # noqa: BLE001 - a peer's crash is a verdict we cannot use
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def math_verify_verdict(response: str, reference: str) -> bool | None:
    from math_verify import parse, verify

    def run() -> bool:
        return verify(parse(f"${reference}$"), parse(response))

    return _bounded(run)


def prm800k_verdict(response: str, reference: str) -> bool | None:
    from mathruler.grader import extract_boxed_content, grade_answer

    return _bounded(lambda: grade_answer(extract_boxed_content(response), reference))


def verdicts(grader, response: str, reference: str, finished: bool = True) -> dict[str, bool | None]:
    """Our verdict and each peer's on one response."""
    return {
        "ours": grader(response, reference, finished=finished).correct,
        "math_verify": math_verify_verdict(response, reference),
        "prm800k": prm800k_verdict(response, reference),
    }


def battery_samples(math_train_every: int):
    """(source, benchmark, probe name, response, reference, truth, grader) for every probe."""
    for name in BATTERY_SOURCES:
        references, grader = battery_problems(name, ROOT / "conf", math_train_every if name == "math_train" else 1)
        for ref in references:
            for probe in probes_for(ref, grader.answer_type):
                response = probe.text if probe.completion else f"The answer is $\\boxed{{{probe.text}}}$."
                yield "battery", name, probe.name, response, ref, probe.kind == "rendering", grader


def table_samples():
    """The same tuples for the (prediction, reference, verdict) pairs of the grader table."""
    import importlib.util

    from rlbench.reward import MathReward

    spec = importlib.util.spec_from_file_location("grader_table", ROOT / "tests" / "test_grader_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    grader = MathReward()
    for param in table.TABLE:
        pred, ref, expected = param.values
        yield "table", "table", param.id, f"The answer is $\\boxed{{{pred}}}$.", ref, expected, grader


def model_samples(paths: list[Path]):
    """The same tuples for the responses of samples.jsonl files (truth None: to be judged)."""
    graders = {}
    for path in paths:
        for line in path.read_text().splitlines():
            s = json.loads(line)
            if s["benchmark"] not in BATTERY_SOURCES:
                continue
            if s["benchmark"] not in graders:
                graders[s["benchmark"]] = battery_problems(s["benchmark"], ROOT / "conf", 10**9)[1]
            yield "model", s["benchmark"], "response", s["completion"], s["reference"], None, graders[s["benchmark"]], s["finished"]


def run(samples) -> dict:
    counts = Counter()
    classes: dict[tuple, list] = defaultdict(list)
    for source, bench, probe, response, ref, truth, grader, *finished in samples:
        v = verdicts(grader, response, ref, finished[0] if finished else True)
        counts["samples"] += 1
        counts[f"{source}_samples"] += 1
        for peer in PEERS:
            if v[peer] is None:
                counts[f"{peer}_no_verdict"] += 1
            if v[peer] == v["ours"]:
                counts[f"{peer}_agree"] += 1
            else:
                right = "unknown" if truth is None else ("ours" if v["ours"] == truth else peer if v[peer] == truth else "neither")
                key = (source, probe, peer, "ours accepts" if v["ours"] else "ours rejects", right)
                classes[key].append((bench, ref, response[-160:]))
        if truth is not None:
            counts["ours_right"] += v["ours"] == truth
            for peer in PEERS:
                counts[f"{peer}_right"] += v[peer] == truth
    ordered = sorted(classes.items(), key=lambda kv: -len(kv[1]))
    return {
        "counts": dict(counts),
        "classes": {" | ".join(k): {"count": len(v), "examples": v[:EXAMPLES_KEPT]} for k, v in ordered},
    }


def report(result: dict, args) -> str:
    c = result["counts"]
    battery = c.get("battery_samples", 0) + c.get("table_samples", 0)
    lines = [
        "# Agreement with peer graders",
        "",
        f"`bench/grader_agreement.py --math-train-every {args.math_train_every}"
        + "".join(f" --samples {p}" for p in args.samples)
        + "`. Peers: math-verify's `verify` used directly, and the PRM800K grader (arXiv:2305.20050, PyPI `mathruler`). "
        "Battery samples have a known truth (a rendering of the reference is right, a canonical wrong answer is wrong).",
        "",
        "| | samples | agree with math-verify | agree with PRM800K |",
        "|---|---|---|---|",
        f"| all | {c['samples']} | {c.get('math_verify_agree', 0)} ({c.get('math_verify_agree', 0) / c['samples']:.2%}) | "
        f"{c.get('prm800k_agree', 0)} ({c.get('prm800k_agree', 0) / c['samples']:.2%}) |",
        "",
    ]
    if battery:
        lines += [
            f"With a known truth (battery {c.get('battery_samples', 0)}, grader table {c.get('table_samples', 0)}; "
            f"model samples {c.get('model_samples', 0)}): "
            + ", ".join(f"{who} right on {c.get(who + '_right', 0)} of {battery} ({c.get(who + '_right', 0) / battery:.2%})" for who in ("ours", *PEERS))
            + f"; no verdict (crash or > {PEER_TIMEOUT_S} s): math-verify {c.get('math_verify_no_verdict', 0)}, PRM800K {c.get('prm800k_no_verdict', 0)}.",
            "",
        ]
    lines += ["## Disagreement classes", "", "source | probe | peer | our verdict | who is right: count, examples (benchmark: reference -> response tail)", ""]
    for key, found in result["classes"].items():
        lines.append(f"- **{key}**: {found['count']}")
        for bench, ref, tail in found["examples"][:3]:
            lines.append(f"  - {bench}: `{ref}` -> `{tail.replace(chr(10), ' ')}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--math-train-every", type=int, default=10, help="every N-th MATH train answer (default 10)")
    parser.add_argument("--samples", type=Path, nargs="*", default=[], help="samples.jsonl files of eval runs")
    parser.add_argument("--no-battery", action="store_true", help="only the model samples")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "eval" / "grader_agreement")
    args = parser.parse_args(argv)
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)

    def samples():
        if not args.no_battery:
            yield from battery_samples(args.math_train_every)
            yield from table_samples()
        yield from model_samples(args.samples)

    result = run(samples())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".md"), report(result, args))
    atomic_write_json(args.out.with_suffix(".json"), result)
    print(json.dumps(result["counts"], indent=1))
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generation time of the HF engine against an earlier commit's, interleaved in one process (A/B).

Both engines sample from the same SmolLM2-135M-Instruct object with the compare_trl.py configuration: 4 arith
prompts x 4 completions, at most 48 new tokens, temperature 1.0, one torch thread (``--threads``).
Repetition r gives both engines the generator seed r (same samples: the engines draw the same tokens),
and the order alternates (old-new, new-old, ...) so that a change of load on a shared machine hits both
alike. The base engine is read with ``git show <base>:rlbench/rollout/engines/hf.py``.

    HF_HUB_OFFLINE=1 python bench/engine_ab.py --base 013c0e8 --reps 6

Prints per-call seconds and the ratio; nothing is written (the figures in results/bench/engine_ab.md and
docs/performance.md were copied from its output).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 7 + 8?", "What is 7 + 0?", "What is 4 + 6?", "What is 6 + 1?"]


def base_engine_class(commit: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:rlbench/rollout/engines/hf.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "base_hf_engine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_hf_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFGenerateEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="013c0e8", help="the commit whose engine is A")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (compare_trl.py uses 2)")
    args = parser.parse_args()
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT))
    from rlbench.config.typed import model_config
    from rlbench.model import load_policy
    from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(model_config(OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml")), seed=0)
    prompts = [tuple(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False))
               for t in PROMPTS]
    requests = [GenerationRequest(p, n=4) for p in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    engines = {"base": base_engine_class(args.base)(model, tokenizer, progress=False), "this": HFGenerateEngine(model, tokenizer, progress=False)}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {name: [] for name in engines}
    for rep in range(args.reps):
        for name in (("base", "this") if rep % 2 == 0 else ("this", "base")):
            start = time.perf_counter()
            out = engines[name].generate(requests, params, torch.Generator().manual_seed(rep))
            seconds[name].append(time.perf_counter() - start)
            tokens[name].append(sum(len(c.response_ids) for group in out for c in group))
        print(f"rep {rep}: base {seconds['base'][-1]:.2f}s, this {seconds['this'][-1]:.2f}s, tokens {tokens['base'][-1]} / "
              f"{tokens['this'][-1]}, load {os.getloadavg()[0]:.1f}", flush=True)
    ratio_call = statistics.median(seconds["this"]) / statistics.median(seconds["base"])
    ratio_token = (sum(seconds["this"]) / sum(tokens["this"])) / (sum(seconds["base"]) / sum(tokens["base"]))
    print(f"median s/call: base {statistics.median(seconds['base']):.2f}, this {statistics.median(seconds['this']):.2f}; "
          f"this/base per call {ratio_call:.3f}, per generated token {ratio_token:.3f}")


if __name__ == "__main__":
    main()

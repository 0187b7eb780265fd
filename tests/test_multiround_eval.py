"""MOTIF's multi-round evaluation (eval.rounds; arXiv:2507.02851): a scripted engine that answers only in a
final round scores 0 single-round and 1 over 3 rounds; the round prompts carry the previous round's response
and the last one the final-round note; each continuation has its own seed, the same before and after.
paper=motif evaluates as the released code does: every benchmark posed in MOTIF's system prompt (eval.prompt),
greedy (temperature 0, one sample: pass@1), which gives the same samples whatever the seed."""

import pytest
from conftest import CharTokenizer, model_preset

from rlbench.dataset.base import Problem
from rlbench.eval.evaluate import Benchmark, evaluate
from rlbench.reward.math import MathReward
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.multiround import FINAL_ROUND_NOTE


class RoundEngine:
    """Answers \\boxed{2} when its prompt says the round is the final one, else 'I am thinking'; records prompts and seeds."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, generator=None):
        self.calls.append([("".join(map(chr, r.prompt_ids)), r.n, r.seed) for r in requests])
        out = []
        for i, r in enumerate(requests):
            text = "so \\boxed{2}" if FINAL_ROUND_NOTE.strip() in "".join(map(chr, r.prompt_ids)) else "I am thinking"
            ids = [ord(ch) for ch in text]
            out.append([Completion(i, r.prompt_ids, ids, [0.0] * len(ids), True, text=text) for _ in range(r.n)])
        return out


def run(rounds, seed=0):
    engine = RoundEngine()
    bench = Benchmark("toy", {"prompt": {"user": "{problem}"}}, [Problem("a", "1+1?", "2"), Problem("b", "3-1?", "2")], MathReward())
    result = evaluate(engine, CharTokenizer(), [bench], n=2, ks=[1], params=SamplingParams(0.6, 0.95, 16), seed=seed, rounds=rounds)
    return result, engine


def test_three_rounds_grade_the_last_round_and_one_round_the_first():
    single, engine = run(1)
    assert single.rows[0]["pass_at_k"] == 0.0 and len(engine.calls) == 1
    multi, engine = run(3)
    assert multi.rows[0]["pass_at_k"] == 1.0 and len(engine.calls) == 3
    first, second, last = engine.calls
    assert [n for _, n, _ in first] == [2, 2] and all(n == 1 for _, n, _ in second + last) and len(second) == len(last) == 4
    assert second[0][0] == "1+1?\n\nProgress in round 1: I am thinking"
    assert last[0][0] == "1+1?\n\nProgress in round 2: I am thinking" + FINAL_ROUND_NOTE
    assert [s["completion"] for s in multi.samples] == ["so \\boxed{2}"] * 4  # the samples are the last rounds


def test_each_continuation_has_its_own_seed_and_the_same_one_again():
    _, engine = run(3, seed=7)
    seeds = [seed for call in engine.calls[1:] for _, _, seed in call]
    assert len(set(seeds)) == len(seeds) == 8
    _, again = run(3, seed=7)
    assert [seed for call in again.calls[1:] for _, _, seed in call] == seeds


def test_rounds_is_a_checked_eval_key(make_cfg):
    from rlbench.config.typed import typed_config
    from rlbench.errors import ConfigError
    from rlbench.validation import validate_config

    assert typed_config(make_cfg("experiment=smoke")).eval.rounds == 1
    assert typed_config(make_cfg("paper=motif", "experiment=smoke")).eval.rounds == 3
    with pytest.raises(ConfigError, match="eval.rounds"):
        validate_config(make_cfg("experiment=smoke", "eval.rounds=0"))


class MessagesTokenizer:
    """A stand-in tokenizer whose chat template is every message's role and content, as characters."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [ord(ch) for m in messages for ch in f"[{m['role']}]{m['content']}"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_paper_motif_poses_every_round_of_every_benchmark_in_the_motif_prompt(make_cfg):
    from omegaconf import OmegaConf

    from rlbench.config.typed import typed_config
    from rlbench.runner import load_benchmarks

    motif_system = OmegaConf.load("conf/dataset/prompt/motif.yaml").system
    config = typed_config(make_cfg("paper=motif")).eval
    assert (config.temperature, config.n, list(config.k), config.rounds) == (0.0, 1, [1], 3)  # greedy pass@1, 3 rounds
    assert config.prompt.system == motif_system and config.prompt.user == "{problem}"
    cfg = make_cfg("paper=motif", "experiment=smoke", "eval.limit=2")  # the smoke suite (arith) in the same prompt
    benchmarks = load_benchmarks(cfg, typed_config(cfg))
    assert [b.name for b in benchmarks] == ["arith"] and dict(benchmarks[0].spec["prompt"]) == {"system": motif_system, "user": "{problem}"}
    assert cfg.eval.benchmarks.arith.prompt.system is None  # the composed config keeps the benchmark's own
    engine = RoundEngine()
    evaluate(engine, MessagesTokenizer(), benchmarks, n=1, ks=[1], params=SamplingParams(0.0, 1.0, 16), seed=0, rounds=3)
    prompts = [prompt for call in engine.calls for prompt, _, _ in call]
    assert len(prompts) == 2 * 3 and all(p.startswith(f"[system]{motif_system}[user]") for p in prompts)
    assert "Progress in round 2: I am thinking" + FINAL_ROUND_NOTE in prompts[-1]
    assert make_cfg("experiment=smoke").eval.get("prompt") is None  # by default each benchmark keeps its own


def test_greedy_multiround_evaluation_gives_the_same_samples_whatever_the_seed():
    from rlbench.model import load_policy
    from rlbench.rollout import HFGenerateEngine

    model, tokenizer = load_policy(model_preset("tiny"), seed=0)
    engine = HFGenerateEngine(model, tokenizer, batch_size=4)
    bench = Benchmark("toy", {"prompt": {"system": "Solve in 3 rounds.", "user": "{problem}"}},
                      [Problem("a", "1+1?", "2"), Problem("b", "3-1?", "2")], MathReward())

    def samples(seed, temperature):
        result = evaluate(engine, tokenizer, [bench], n=2, ks=[1], params=SamplingParams(temperature, 1.0, 6), seed=seed, rounds=3)
        return [s["completion"] for s in result.samples]

    greedy = samples(0, 0.0)
    assert samples(1, 0.0) == greedy and greedy[0] == greedy[1] and greedy[2] == greedy[3]  # one answer per problem
    assert samples(1, 1.0) != samples(0, 1.0)  # sampled: the seed matters

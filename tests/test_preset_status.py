"""Every preset says whether it is faithful (docs/papers.md, "Fidelity"): the ``fidelity`` block
(rlbench.config.schema.FidelityConfig) on every paper preset, and on the algorithm, rollout and
prompt-sampler presets named after a method that is partial; the run's start-up lines
(rlbench.validation.notice_fidelity); the status column of the papers table (docs/gen_tables.py).

The YAML files are read directly where a check needs no composition (composing all presets costs half a
minute); the start-up lines are checked on composed configs, including a user composition.
"""

from __future__ import annotations

import logging
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
import gen_tables  # noqa: E402
from conftest import ROOT, compose_config  # noqa: E402
from test_distinguishing_terms import PAPER_OUTCOMES  # noqa: E402

from rlbench.config.schema import FidelityConfig  # noqa: E402
from rlbench.config.typed import node_config, typed_config  # noqa: E402
from rlbench.config.walk import check_against_schema  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.validation import (  # noqa: E402
    check_fidelity,
    fidelity_problem,
    notice_fidelity,
    registered,
)

CONF = ROOT / "conf"
PAPERS = sorted(path.stem for path in (CONF / "paper").glob("*.yaml"))
STATUSES = typing.get_args(typing.get_type_hints(FidelityConfig)["status"])
# The presets that may carry a fidelity block, and where in their file it sits.
METHOD_PRESET_GROUPS = ("algorithm", "rollout", "prompt_sampler", "reward")

# A deviation that says a mechanism "is not implemented" belongs to a partial preset. These sentences say it
# of something that does not define the method (a variant, an ablation, a script's extra); each says why.
NOT_DEFINING = {
    ("paper", "gpg"): "beta_th is a threshold of the README's ablation variant, not of GPG's advantage",
    ("algorithm", "gpg"): "filtering or thresholds beyond the advantage were not found in the paper",
    ("paper", "ngrpo"): "the script's all-correct group filter is DAPO's, not part of NGRPO's advantage calibration",
    ("algorithm", "ngrpo"): "the script's all-correct group filter is DAPO's, not part of NGRPO's advantage calibration",
    ("paper", "nlpo"): "min_tokens_to_keep is an RL4LMs implementation floor under the top-p mask",
    ("paper", "treerpo"): "the pruning threshold is quoted by reviews, not part of the tree-relative advantage",
    ("algorithm", "d3s"): "a per-response threshold is an alternative to the paper's batch-level token ranking",
    ("algorithm", "dmpo"): "the other weight baselines and WDDO are the paper's other variants",
    ("algorithm", "sfpo"): "the warm-up and patience come from later versions of the released code, not the paper",
}
SAYS_NOT_BUILT = re.compile(r"\bnot implemented\b|\b(?:is|are) missing\b", re.IGNORECASE)


def preset_file(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text()) or {}


def paper_fidelity(name: str) -> dict | None:
    return (preset_file("paper", name).get("paper") or {}).get("fidelity")


def method_presets() -> dict[tuple[str, str], dict]:
    """(group, preset) -> the fidelity block of every algorithm, rollout and prompt-sampler preset that has one."""
    blocks = {}
    for group in METHOD_PRESET_GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            block = (yaml.safe_load(path.read_text()) or {}).get("fidelity")
            if block is not None:
                blocks[(group, path.stem)] = block
    return blocks


def as_block(values: dict) -> FidelityConfig:
    return node_config(values, FidelityConfig)


# ------------------------------------------------------------------------------------ the block itself


@pytest.mark.parametrize("values, problem", [
    ({"status": "faithful"}, None),
    ({"status": "partial", "missing": "the X filter is not built"}, None),
    ({"status": "partial", "missing": "the X filter", "adapted": "GUI agents become math"}, None),
    ({"status": "adapted", "adapted": "GUI agents become math"}, None),
    ({"status": "partial"}, "needs fidelity.missing"),
    ({"status": "partial", "missing": "   "}, "needs fidelity.missing"),
    ({"status": "adapted"}, "needs fidelity.adapted"),
    ({"status": "adapted", "adapted": "x", "missing": "y"}, "takes no fidelity.missing"),
    ({"status": "faithful", "missing": "y"}, "takes no fidelity.missing"),
    ({"status": "faithful", "adapted": "x"}, "takes no fidelity.adapted"),
    ({"missing": "y"}, "needs fidelity.status"),
])
def test_a_block_carries_the_text_its_status_needs(values, problem):
    found = fidelity_problem(as_block(values))
    assert (found is None) if problem is None else (problem in found)


def test_every_paper_preset_states_its_fidelity():
    for name in PAPERS:
        block = paper_fidelity(name)
        assert block is not None, f"conf/paper/{name}.yaml: add paper.fidelity (docs/papers.md, 'Fidelity')"
        assert block["status"] in STATUSES, name
        assert fidelity_problem(as_block(block)) is None, name
        if block["status"] == "partial":
            assert block["missing"].strip(), name


def test_every_method_preset_block_is_partial_and_names_its_method():
    """Beside the paper presets, a block sits only where the method is partial, and names the method (the
    rollout rethink composes the strategy of Cog-Rethinker, the prompt sampler clpo is CLPO)."""
    blocks = method_presets()
    assert {("rollout", "rethink"), ("prompt_sampler", "clpo"),
            ("algorithm", "intellect2")} <= set(blocks)
    for (group, name), block in blocks.items():
        assert block["status"] == "partial" and fidelity_problem(as_block(block)) is None, (group, name)
        assert block.get("method"), f"conf/{group}/{name}.yaml: fidelity.method names the method in the start-up line"


def _not_built_sentences(deviations) -> list[str]:
    return [sentence for sentence in deviations or [] if SAYS_NOT_BUILT.search(sentence)]


def test_deviations_that_say_a_mechanism_is_not_built_are_on_partial_presets():
    """A deviation saying "not implemented" / "is missing" on a preset not marked partial is either a status
    to change or a piece that does not define the method, listed in NOT_DEFINING with the reason."""
    algorithm_blocks = {name: block for (group, name), block in method_presets().items() if group == "algorithm"}
    claims = {}
    for name in PAPERS:
        raw = preset_file("paper", name).get("paper") or {}
        claims[("paper", name)] = (_not_built_sentences(raw.get("deviations")), (raw.get("fidelity") or {}).get("status"))
    for path in sorted((CONF / "algorithm").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        claims[("algorithm", path.stem)] = (_not_built_sentences(raw.get("deviations")),
                                            (algorithm_blocks.get(path.stem) or {}).get("status"))
    unmarked = {key: sentences for key, (sentences, status) in claims.items()
                if sentences and status != "partial" and key not in NOT_DEFINING}
    assert not unmarked, f"mark these presets partial (fidelity.missing), or list the sentence in NOT_DEFINING: {unmarked}"
    stale = {key for key in NOT_DEFINING if not claims.get(key, ([], None))[0] or claims[key][1] == "partial"}
    assert not stale, f"NOT_DEFINING entries no longer needed: {sorted(stale)}"


def test_a_paper_preset_whose_distinguishing_term_is_inactive_is_partial():
    """The paper presets that print notice_inactive_terms' line (tests/test_distinguishing_terms.py) train the
    base loss: the term that defines the method is built but not active, so the preset is partial."""
    for name, outcome in PAPER_OUTCOMES.items():
        if outcome == "notice":
            block = paper_fidelity(name)
            assert block["status"] == "partial" and "inactive" in block["missing"], name


# ------------------------------------------------------------------------------------ validation


def test_a_wrong_status_is_refused_with_the_choices(tmp_path):
    cfg = compose_config(["paper=grpo", "paper.fidelity.status=partly"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"paper\.fidelity\.status='partly' is unknown.*partial"):
        check_against_schema(cfg, registered())


def test_an_unknown_key_in_a_block_is_refused_with_the_nearest_spelling(tmp_path):
    cfg = compose_config(["rollout=micro_groups", "+rollout.fidelity.mising=x"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"rollout\.fidelity\.mising.*did you mean 'missing'"):
        check_against_schema(cfg, registered())


def test_a_partial_paper_without_missing_is_refused(tmp_path):
    cfg = compose_config(["paper=grpo", "paper.fidelity.status=partial"], tmp_path / "run")
    check_against_schema(cfg, registered())
    with pytest.raises(ConfigError, match=r"paper=grpo: fidelity\.status=partial needs fidelity\.missing"):
        check_fidelity(typed_config(cfg))


def test_the_typed_config_holds_the_block_as_its_dataclass(tmp_path):
    config = typed_config(compose_config(["paper=intellect2"], tmp_path / "run"))
    assert isinstance(config.paper["fidelity"], FidelityConfig) and config.paper["fidelity"].status == "partial"
    assert isinstance(config.algorithm.fidelity, FidelityConfig) and config.rollout.fidelity is None


# ------------------------------------------------------------------------------------ the start-up lines


def _lines(overrides: list[str], tmp_path: Path, caplog) -> list[str]:
    cfg = compose_config(overrides, tmp_path / "run")
    check_against_schema(cfg, registered())
    config = typed_config(cfg)
    check_fidelity(config)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlbench.validation"):
        lines = notice_fidelity(config)
    assert [record.getMessage() for record in caplog.records] == lines  # each line is logged, once
    return lines


def test_a_partial_paper_says_so_once_per_partial_preset(tmp_path, caplog):
    lines = _lines(["paper=intellect2"], tmp_path, caplog)
    paper, algorithm = (paper_fidelity("intellect2")["missing"], preset_file("algorithm", "intellect2")["fidelity"]["missing"])
    assert lines == [f"paper=intellect2 is partial: {paper}", f"algorithm=intellect2 (INTELLECT-2) is partial: {algorithm}"]
    assert all("\n" not in line for line in lines)


def test_an_adapted_paper_says_how(tmp_path, caplog):
    assert _lines(["paper=edit_grpo"], tmp_path, caplog) == [
        f"paper=edit_grpo is adapted: {paper_fidelity('edit_grpo')['adapted']}"]


def test_a_faithful_paper_and_a_plain_run_say_nothing(tmp_path, caplog):
    assert _lines(["paper=grpo"], tmp_path, caplog) == []
    assert _lines([], tmp_path, caplog) == []


def test_a_user_composition_names_each_partial_preset_and_its_method(tmp_path, caplog):
    lines = _lines(["algorithm=dapo", "rollout=rethink", "prompt_sampler=clpo"], tmp_path, caplog)
    assert [line.split(" is partial: ")[0] for line in lines] == ["rollout=rethink (Cog-Rethinker)", "prompt_sampler=clpo (CLPO)"]
    assert lines[1].endswith(preset_file("prompt_sampler", "clpo")["fidelity"]["missing"])


def test_no_line_outside_training(tmp_path, caplog):
    assert _lines(["paper=intellect2", "mode=eval"], tmp_path, caplog) == []


# ------------------------------------------------------------------------------------ the papers table


def test_fidelity_cell():
    def cell(values):
        return gen_tables.fidelity_cell(OmegaConf.create(values))

    assert cell({"status": "faithful"}) == "faithful"
    assert cell({"status": "partial", "missing": "no  filter,\n no refresh"}) == "partial: no filter, no refresh"
    assert cell({"status": "adapted", "adapted": "X-ray reports become math"}) == "adapted: X-ray reports become math"
    assert gen_tables.fidelity_cell(None) == "not stated"


def test_the_papers_table_shows_each_presets_status():
    """Each paper's row holds the cell built from its own block (test_docs checks the table is regenerated)."""
    page = (ROOT / "docs" / "papers.md").read_text()
    rows = {match.group(1): match.group(0) for match in re.finditer(r"^\|.*`rlbench paper=(\w+)` \|$", page, re.MULTILINE)}
    assert set(rows) == set(PAPERS)
    for name in PAPERS:
        cell = gen_tables.fidelity_cell(OmegaConf.create(paper_fidelity(name)))
        assert f"| {cell.replace('|', chr(92) + '|')} |" in rows[name], name

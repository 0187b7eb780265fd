"""Tree-OPO's Staged Advantage Estimation (SAE; Huang, Nguyen & Zimmer 2025, arXiv:2509.09284, section 4) for
the groups of ``rollout=mcts_prefix`` (rlbench/rollout/strategies/mcts_prefix.py), whose group holds a
prompt's completions of prefixes of one teacher solution revealed to several depths (stages).

Reads ``prefix_stage`` [B,T] long: the depth (revealed segments) of the prefix each response completes, on every
token of the response, -1 on padding, and (``baseline: tree_value``) ``prefix_value`` [B,T] float64: V(p) of that
prefix in the search tree (step inputs of rollout=mcts_prefix; rlbench/algorithm/step_inputs.py).

Source note: the paper's sections 3-5 were not read here (its arXiv HTML is reachable only up to the introduction);
the heuristic baseline r_i - alpha V(p_i) (alpha = 0.5, mean-centred, no std scaling) and the soft-SAE quadratic
program below follow second-hand summaries of it (themoonlight.io's review, cognaptus.com's blog, notes that quote
the program), as docs/rollout-trees.md says.
"""

from __future__ import annotations

import math

import torch

from rlbench.algorithm.advantages.common import _broadcast, group_mean_std
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError

BASELINES = ("stages", "tree_value")
PROJECTIONS = ("none", "soft")


def ordered_means(means: list[float], weights: list[float]) -> list[float]:
    """The weighted L2 projection of ``means`` (stages in increasing depth) onto the non-decreasing sequences:
    argmin_b sum_d w_d (b_d - m_d)^2 subject to b_1 <= b_2 <= ... (pool-adjacent-violators: a pair of
    neighbours out of order is replaced by its weighted mean, repeatedly)."""
    blocks: list[list[float]] = []  # [weighted mean, weight, stages]
    for mean, weight in zip(means, weights):
        blocks.append([mean, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(w1 * m1 + w2 * m2) / (w1 + w2), w1 + w2, c1 + c2]
    return [mean for mean, _, count in blocks for _ in range(count)]


def response_stages(prefix_stage: torch.Tensor) -> torch.Tensor:
    """[B] long: each response's stage, read from ``prefix_stage`` (the same on every token of a response; -1 for
    a row without tokens)."""
    stage = prefix_stage.long()
    rows = stage.max(dim=1).values
    if bool((torch.where(stage >= 0, stage, rows[:, None]) != rows[:, None]).any()):
        raise ValueError("prefix_stage varies along a response: a response completes one prefix")
    return rows


def order_start(n: int, pairs: list[tuple[int, int]], margins: list[float]) -> torch.Tensor:
    """A point of {a in R^n : a_i + delta_k <= a_j for (i, j) = pairs[k]}: the longest margin path into each
    coordinate from 0 (relaxed n times; still changing after that means a cycle of positive margins: empty set)."""
    a = torch.zeros(n, dtype=torch.float64)
    for _ in range(n + 1):
        changed = False
        for (i, j), d in zip(pairs, margins):
            if a[i] + d > a[j]:
                a[j], changed = a[i] + d, True
        if not changed:
            return a
    raise ValueError(f"the ordering constraints {pairs} with margins {margins} have a cycle of positive margins: no point satisfies them")


def project_order(r: torch.Tensor, pairs: list[tuple[int, int]], margins: list[float], tol: float = 1e-13) -> torch.Tensor:
    """The Euclidean projection of ``r`` [n] onto {a : a_i + delta_k <= a_j for (i, j) = pairs[k]} (L a <= b with
    L_k = e_i - e_j, b_k = -delta_k): argmin_a 1/2 ||a - r||^2 s.t. L a <= b, by the primal active-set method
    (Nocedal & Wright, Numerical Optimization, Algorithm 16.3) from :func:`order_start`: step to the minimiser on the
    working set's equalities, stop at the first blocking constraint (added), drop the constraint of the most negative
    multiplier once the step is zero; finite, exact up to rounding."""
    r = r.to(torch.float64)
    n = r.numel()
    if not pairs:
        return r.clone()
    L = torch.zeros(len(pairs), n, dtype=torch.float64)
    for k, (i, j) in enumerate(pairs):
        L[k, i], L[k, j] = 1.0, -1.0
    b = -torch.tensor(margins, dtype=torch.float64)
    a, working = order_start(n, pairs, margins), []
    scale = tol * max(1.0, float(r.abs().max()), float(b.abs().max()))
    for _ in range(50 * (len(pairs) + n)):
        g = r - a
        if working:
            lw = L[working]
            y = torch.linalg.lstsq(lw.T, g[:, None]).solution[:, 0]  # the multipliers: lw^T y is g's part in lw's row space
            p = g - lw.T @ y
        else:
            y, p = g.new_zeros(0), g
        if float(p.abs().max()) <= scale:
            if not working or float(y.min()) >= -scale:
                return a
            working.pop(int(y.argmin()))
            continue
        lp, slack = L @ p, (b - L @ a).clamp(min=0)
        step, block = 1.0, None
        for k in range(len(pairs)):
            if k not in working and float(lp[k]) > scale and float(slack[k] / lp[k]) < step:
                step, block = float(slack[k] / lp[k]), k
        a = a + step * p
        if block is not None:
            working.append(block)
    raise RuntimeError("project_order: the active-set method did not terminate (cycling)")


def soft_sae_projection(r0: torch.Tensor, pairs: list[tuple[int, int]], margin: float = 0.0) -> torch.Tensor:
    """Soft SAE (Tree-OPO, arXiv:2509.09284, section 4, as quoted second-hand): the advantages of a group of N
    responses are

        a* = argmin_a 1/2 ||a - r0||^2   s.t.  1^T a = 0,  ||a||^2 <= N,  a_i + delta <= a_j for (i, j) in C_order

    Solved exactly: with P = {1^T a = 0} & {order}, whose order constraints are differences (P's projection of r0
    is the order projection of r0 - mean(r0): its multipliers sum to 0 over every row of L), dualising the ball
    alone gives a* = Proj_P(r0 / (1 + mu)) with mu >= 0 the smallest for which ||a*||^2 <= N. With delta = 0, P is a
    cone and a* = Proj_P(r0) * min(1, sqrt(N) / ||Proj_P(r0)||); with delta > 0, mu is bisected (||a*|| falls as mu
    grows). Empty (margins the ball cannot hold): ValueError."""
    r0 = r0.to(torch.float64)
    n, centred = r0.numel(), r0 - r0.mean()
    margins = [float(margin)] * len(pairs)

    def at(t: float) -> torch.Tensor:
        a = project_order(t * centred, pairs, margins)
        return a - a.mean()  # 0 up to rounding; a shift keeps every order constraint

    a = at(1.0)
    norm2 = float(a @ a)
    if norm2 <= n:
        return a
    if margin == 0.0:
        return a * math.sqrt(n / norm2)
    if float((z := at(0.0)) @ z) > n:
        raise ValueError(f"soft SAE: margins {margin} on {pairs} do not fit in the ball ||a||^2 <= {n}")
    low, high = 0.0, 1.0  # t = 1 / (1 + mu): ||at(t)||^2 <= n at low, > n at high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if float((m := at(mid)) @ m) <= n else (low, mid)
        if high - low < 1e-15:
            break
    return at(low)


def order_pairs(rewards: list[float], stages: list[int]) -> list[tuple[int, int]]:
    """C_order of a group (indices into it), as quoted second-hand: (i, j) where i's prefix is a proper prefix of j's
    (a shallower depth of the same solution: a group's prefixes are one solution's) and i failed where j succeeded
    (r_i < r_j). The sibling triplets are empty here: a step's prefixes of one prompt lie on one path."""
    return [(i, j) for i in range(len(rewards)) for j in range(len(rewards)) if stages[i] < stages[j] and rewards[i] < rewards[j]]


def check_sae(params) -> None:
    if params["baseline"] not in BASELINES:
        raise ConfigError(f"algorithm.advantage.baseline must be one of {list(BASELINES)}, got {params['baseline']!r}")
    if params["projection"] not in PROJECTIONS:
        raise ConfigError(f"algorithm.advantage.projection must be one of {list(PROJECTIONS)}, got {params['projection']!r}")
    if params["margin"] < 0 or params["alpha"] < 0:
        raise ConfigError(f"algorithm.advantage.margin={params['margin']} and .alpha={params['alpha']} must be >= 0")


@ADVANTAGES.register("sae", check_params=check_sae)
def sae_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    prefix_stage: torch.Tensor,
    response_mask: torch.Tensor,
    prefix_value: torch.Tensor | None = None,
    baseline: str = "stages",
    ordered: bool = True,
    epsilon: float = 1e-6,
    alpha: float = 0.5,
    projection: str = "none",
    margin: float = 0.0,
) -> torch.Tensor:
    """Staged Advantage Estimation (Tree-OPO, Huang, Nguyen & Zimmer 2025, arXiv:2509.09284, section 4: "projecting
    rewards onto a constraint set that respects the tree's hierarchy"). A prompt g's group holds completions of
    the prefixes p_d of one teacher solution at stages (depths) d; S_{g,d} are those of stage d, n_{g,d} their
    number and m_{g,d} their mean reward. The baselines are the stage means projected onto the tree's order
    (a deeper prefix of the solution is not worth less than a shallower one: V(p_d) <= V(p_{d+1})):

        b_g = argmin_b sum_d n_{g,d} (b_d - m_{g,d})^2   s.t.  b_d <= b_{d'} for d < d'   (ordered=true;
                                                              ordered=false: b_{g,d} = m_{g,d})
        sigma_g^2 = sum_d sum_{i in S_{g,d}} (r_i - m_{g,d})^2 / (N_g - D_g)      (pooled within-stage variance)
        A_i = (r_i - b_{g,d(i)}) / (sigma_g + epsilon)

    N_g, D_g: the group's responses and stages. The baseline is keyed by (prompt, prefix), so a deep prefix's
    high success rate is not compared with the prompt alone's; the scale is pooled over the prompt's stages, so
    a stage whose rewards are all equal (a saturated deep prefix) still gets a finite advantage. A group with
    sigma_g = 0 (or N_g = D_g) gets A = 0. With one stage it is GRPO's advantage exactly (b = the group mean,
    sigma = its unbiased std). The ordered projection (pool-adjacent-violators, :func:`ordered_means`) stands
    in for the paper's quadratic program, whose constraint set was not read here (the abstract only); the
    pooled scale is this project's choice.

    ``baseline: tree_value`` (the paper's heuristic as summarised second-hand): with V(p_i) the prefix's value in
    the search tree (``prefix_value``: its subtree's success rate, optimistic or pessimistic; rollout=mcts_prefix)

        a'_i = r_i - alpha V(p_i),     A_i = a'_i - mean_{j in g} a'_j        (mean-centred, scale c = 1: no std)

    One prefix per group: V cancels and A = r - mean (Dr. GRPO's advantage). ``projection: soft`` then replaces
    each group's advantages by the soft-SAE program's solution from them (:func:`soft_sae_projection`, C_order of
    :func:`order_pairs`, every margin ``margin``), after either baseline.
    """
    stages, groups = response_stages(prefix_stage), group_index.long()
    if baseline == "tree_value":
        if prefix_value is None:
            raise ValueError("sae baseline=tree_value reads prefix_value (rollout=mcts_prefix provides it)")
        raw = rewards.to(torch.float64) - alpha * prefix_value.to(torch.float64)[:, 0]
        mean, _, _ = group_mean_std(raw, groups)
        return _broadcast(project_groups(raw - mean, rewards, groups, stages, projection, margin).float(), response_mask)
    pairs, keys = torch.unique(torch.stack([groups, stages], 1), dim=0, return_inverse=True)  # one key per (prompt, prefix)
    mean, _, _ = group_mean_std(rewards, keys)
    values = rewards.to(torch.float64)
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    within = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, groups, (values - mean) ** 2)
    count = torch.bincount(groups, minlength=num_groups).to(torch.float64)
    stage_count = torch.bincount(pairs[:, 0], minlength=num_groups).to(torch.float64)
    sigma = (within / (count - stage_count).clamp(min=1)).sqrt()[groups]
    baseline = mean.clone()
    if ordered:  # pairs are sorted by (prompt, stage): each prompt's stages in increasing depth
        key_mean = torch.zeros(len(pairs), dtype=torch.float64, device=values.device).index_add_(0, keys, values)
        key_count = torch.bincount(keys, minlength=len(pairs)).to(torch.float64)
        projected = key_mean / key_count
        for g in pairs[:, 0].unique().tolist():
            of_g = (pairs[:, 0] == g).nonzero().flatten()
            projected[of_g] = torch.tensor(ordered_means((projected[of_g]).tolist(), key_count[of_g].tolist()), dtype=torch.float64)
        baseline = projected[keys]
    advantage = torch.where(sigma > 0, (values - baseline) / (sigma + epsilon), torch.zeros_like(values))
    return _broadcast(project_groups(advantage, rewards, groups, stages, projection, margin).float(), response_mask)


def project_groups(advantage: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor, stages: torch.Tensor,
                   projection: str, margin: float) -> torch.Tensor:
    """``advantage`` [B] with each group's entries replaced by :func:`soft_sae_projection` of them (projection
    "soft"), or unchanged ("none")."""
    if projection == "none":
        return advantage
    out = advantage.to(torch.float64).clone()
    for g in groups.unique().tolist():
        rows = (groups == g).nonzero().flatten()
        pairs = order_pairs(rewards[rows].tolist(), stages[rows].tolist())
        out[rows] = soft_sae_projection(out[rows].cpu(), pairs, margin).to(out.device)
    return out


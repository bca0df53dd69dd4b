"""The ``branch`` sampler (BranchGRPO): tree rollouts, split noise, per-depth tree advantages, pruning."""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_same_training, metric_rows, registration, stop_and_resume
from fgrpo.core import cli, registry
from fgrpo.core.advantages import group_advantages, tree_advantages
from fgrpo.core.points.transitions import step_advantages
from fgrpo.core.testing import SamplerConformance
from fgrpo.core.testing.toys import GaussianPolicy
from fgrpo.samplers.branch import BranchSampler

PROMPTS = ["a cat", "a dog"]


#: the entry point, where the editable install predates it (a fresh install registers it)
branch_registered = registration("sampler", "branch", BranchSampler)


class TestBranchSampler(SamplerConformance):
    sampler_name = "branch"
    sampler_params = {"steps": 6, "split_points": [0, 2]}
    bad_params = {"split_points": [0, 6]}
    group_size = 4


class TestBranchSamplerSlidingPruning(SamplerConformance):
    sampler_name = "branch"
    sampler_params = {
        "steps": 8,
        "depth_pruning": [7, 8],
        "depth_pruning_slide": True,
        "depth_pruning_slide_interval": 3,
        "kernel": {"name": "sde", "eta": 0.7},
        "final": "sample",
    }
    bad_params = {"depth_pruning": [0]}
    group_size = 4


def rollout(sampler, policy, group, seed, prompts=PROMPTS):
    return sampler.rollout(policy, prompts, group, generator=torch.Generator().manual_seed(seed))


# --- hand computations ---------------------------------------------------------------------------


def test_leaves_shared_prefix_and_one_evaluation_per_node_by_hand():
    """steps 6, splits at 0 and 2: nodes per tree before each step 1, 2, 2, 4, 4, 4 (a split doubles
    the nodes after it); 2 prompts: the network sees 2, 4, 4, 8, 8, 8 rows (34, not 6 x 8 = 48), and
    each tree has 2^2 = 4 leaves and 2 + 2 + 4 + 4 + 4 + 4 = 20 edges."""
    policy = GaussianPolicy(shape=(3,))
    sampler = registry.create("sampler", "branch", steps=6, split_points=[0, 2])
    traj = rollout(sampler, policy, 4, 0)
    assert traj.batch_size == 8 and traj.step_index.tolist() == [list(range(6))] * 8
    assert policy.rows == [2, 4, 4, 8, 8, 8] and traj.nfe == 34
    assert traj.info["nfe"] == {"shared": 2 + 4 + 4, "leaves": 24}
    assert traj.info["tree_edges"] == 2 * 20
    # leaves 0 and 1 of a tree share the edge of step 0 and 1 (node 0 of depth 1 and 2), split at step 2
    for p in range(2):
        rows = traj.latents[4 * p : 4 * p + 4]
        assert torch.equal(rows[0, :3], rows[1, :3]) and torch.equal(rows[2, :3], rows[3, :3])
        assert not torch.equal(rows[0, 1], rows[2, 1])  # the split at step 0 made two children
        assert torch.equal(traj.next_latents[4 * p, :2], traj.next_latents[4 * p + 1, :2])
        assert not torch.equal(traj.next_latents[4 * p, 2], traj.next_latents[4 * p + 1, 2])
    assert traj.step_nodes.tolist()[:4] == [
        [0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [1, 1, 2, 2, 2, 2],
        [1, 1, 3, 3, 3, 3],
    ]
    # only the first leaf below a node trains its edge: 20 weights of 1 per tree
    assert traj.policy_weight[:4].tolist() == [[1.0] * 6, [0, 0, 1, 1, 1, 1], [1.0] * 6, [0, 0, 1, 1, 1, 1]]


def test_default_split_points_are_the_references_uniform_rounds():
    """split_points null: log2(G) rounds at i * (steps // rounds): G = 8, steps 10 -> 0, 3, 6."""
    traj = rollout(registry.create("sampler", "branch", steps=10), GaussianPolicy(shape=(2,)), 8, 0)
    assert traj.info["split_points"] == [0, 3, 6]
    assert traj.info["nodes"] == [1, 2, 2, 2, 4, 4, 4, 8, 8, 8]


def test_tree_advantage_on_a_two_level_tree_by_hand():
    """G = 4, splits at 0 and 1, rewards 1, 2, 3, 6. Depth 1: node means 1.5 and 4.5 -> two nodes z-scored
    with the unbiased std |4.5 - 1.5| / sqrt 2: -1/sqrt 2, +1/sqrt 2. Depth 2 (the leaves): mean 3,
    deviations -2, -1, 0, 3, unbiased std sqrt(14 / 3). The leaves' group advantages are any positive
    affine map of the rewards: the per-depth z-scores do not change (up to the 1e-8 epsilon)."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    group = torch.zeros(4, dtype=torch.long)
    leaf_adv, _ = group_advantages(rewards, group)
    nodes = torch.tensor([[0, 0], [0, 1], [1, 2], [1, 3]])  # depth 1, depth 2
    adv = tree_advantages(leaf_adv, group, nodes)
    s = math.sqrt(14 / 3)
    h = 1 / math.sqrt(2)
    expected = torch.tensor([[-h, -2 / s], [-h, -1 / s], [h, 0.0], [h, 3 / s]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_flat_depths_and_single_nodes_have_zero_advantage():
    """Rewards 1, 3, 3, 1: the two depth-1 nodes both average 2 (a flat depth: 0); a tree of equal
    rewards is flat everywhere; a depth with one node (before the first split) is 0."""
    group = torch.zeros(4, dtype=torch.long)
    nodes = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 2], [0, 1, 3]])
    leaf_adv, _ = group_advantages(torch.tensor([1.0, 3.0, 3.0, 1.0]), group)
    adv = tree_advantages(leaf_adv, group, nodes)
    assert adv[:, :2].abs().max().item() == 0.0 and adv[:, 2].abs().min().item() > 0.5
    flat, _ = group_advantages(torch.full((4,), 0.7), group)
    assert tree_advantages(flat, group, nodes).abs().max().item() == 0.0


def test_the_update_gives_each_step_its_nodes_advantage_times_the_owner_weight():
    traj = rollout(
        registry.create("sampler", "branch", steps=4, split_points=[1, 2]), GaussianPolicy(shape=(2,)), 4, 1
    )
    leaf_adv, _ = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3, 0.3, 0.8, 0.0]), traj.group_index)
    table = tree_advantages(leaf_adv, traj.group_index, traj.step_nodes)
    rows, cols = torch.arange(8).repeat_interleave(4), torch.arange(4).repeat(8)
    got = step_advantages(traj, table, rows, cols)
    torch.testing.assert_close(got, (table * traj.policy_weight.double())[rows, cols], atol=0, rtol=0)
    assert (
        step_advantages(traj, leaf_adv, rows, cols).tolist()
        == (leaf_adv[rows] * traj.policy_weight[rows, cols]).tolist()
    )


def test_a_leaf_with_zero_advantage_still_trains_its_ancestors_edges():
    """Rewards 2, 1, 3, 2 (mean 2): leaf 0's own advantage is 0, but it owns the edges into depth 1
    and 2's first node (means 1.5 of leaves 0-1 vs 2.5 of leaves 2-3: +-1/sqrt 2), so the zero-advantage
    filter must keep it; leaf 3 (also 0) owns only its own edges and is left out."""
    from fgrpo.core.points.transitions import Transitions

    sampler = registry.create("sampler", "branch", steps=3, split_points=[0, 1])
    traj = rollout(sampler, GaussianPolicy(shape=(2,)), 4, 0, prompts=PROMPTS[:1])
    leaf_adv, _ = group_advantages(torch.tensor([2.0, 1.0, 3.0, 2.0]), traj.group_index)
    assert leaf_adv[0] == 0 and leaf_adv[3] == 0
    points = Transitions(None, traj, leaf_adv)  # type: ignore[arg-type]  # the run is not read here
    assert points.advantages[0].item() == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    assert points.advantages[3].item() == 0.0 and points.advantages[1].item() > 0


# --- the naive float64 twin from the reference's definitions -------------------------------------


def naive_tree(policy, prompts, group, steps, splits, seed, eta, scale):
    """Float64, node by node as ``run_tree_sample_step`` and ``flux_step_with_split`` (sde_solver):
    x0 = x - sigma v, score = -(x - (1 - sigma) x0) / sigma^2, mean = x + dsigma v - eta^2 / 2 score
    dsigma, std = eta sqrt(sigma - sigma'), a child x' = mean + scale * eps * std (scale 1 off the
    split points), log-prob of the unscaled Gaussian averaged over dims; a split node has two
    children in order. Draws in the sampler's order: the roots, then each step's eps, node by node.
    Returns the leaves (each with its path of (x, x', logp) edges and its last x0), in order."""
    g = torch.Generator().manual_seed(seed)
    sigmas = policy.sigmas(steps).double()
    roots = torch.randn((len(prompts), *policy.shape), generator=g).double()
    means = [policy._prompt_mean(p).double() for p in prompts]
    nodes = [{"x": roots[p], "prompt": p, "path": []} for p in range(len(prompts))]
    for i in range(steps):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        children = 2 if i in splits else 1
        eps = torch.randn((len(nodes) * children, *policy.shape), generator=g).double()
        grown = []
        for j, node in enumerate(nodes):
            x = node["x"]
            with torch.no_grad():
                v = policy._velocity(
                    x[None], torch.full((1,), sigma, dtype=torch.float64), means[node["prompt"]][None]
                )[0]
            x0 = x - sigma * v
            score = -(x - x0 * (1 - sigma)) / sigma**2
            mean = x + (sigma_next - sigma) * v + (-0.5 * eta**2 * score) * (sigma_next - sigma)
            std = eta * math.sqrt(sigma - sigma_next)
            for c in range(children):
                x1 = mean + eps[j * children + c] * (scale if children == 2 else 1.0) * std
                logp = (-((x1 - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()
                grown.append({"x": x1, "prompt": node["prompt"], "path": [*node["path"], (x, x1, logp)], "x0": x0})
        nodes = grown
    assert len(nodes) == len(prompts) * group
    return nodes


def naive_tree_advantages(rewards, group, steps, splits):
    """``compute_node_rewards_from_leaves`` (mean of the leaf descendants) and
    ``compute_hierarchical_advantages_by_depth`` (per depth, unbiased std, 0 below 1e-6, + 1e-8) on
    the raw rewards of one tree, node by node; the advantage of leaf b's edge into depth d + 1."""
    out = torch.zeros(group, steps, dtype=torch.float64)
    for depth in range(1, steps + 1):
        width = 2 ** sum(1 for s in splits if s < depth)
        size = group // width  # leaves below a node of this depth
        node_rewards = [sum(rewards[k * size : (k + 1) * size].tolist()) / size for k in range(width)]
        r = torch.tensor(node_rewards, dtype=torch.float64)
        if width <= 1 or r.std() < 1e-6:
            adv = torch.zeros(width, dtype=torch.float64)
        else:
            adv = (r - r.mean()) / (r.std() + 1e-8)
        for b in range(group):
            out[b, depth - 1] = adv[b // size]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_matches_the_naive_float64_tree_of_the_reference(seed):
    policy = GaussianPolicy(shape=(5,))
    splits, steps, group, eta, scale = [0, 2, 3], 6, 8, 0.3, 4.0
    sampler = registry.create(
        "sampler",
        "branch",
        steps=steps,
        split_points=splits,
        split_noise_scale=scale,
        kernel={"name": "dance", "eta": eta},
    )
    traj = rollout(sampler, policy, group, seed)
    leaves = naive_tree(policy, PROMPTS, group, steps, splits, seed, eta, scale)
    for b, leaf in enumerate(leaves):
        for s, (x, x1, logp) in enumerate(leaf["path"]):
            torch.testing.assert_close(traj.latents[b, s].double(), x, atol=1e-6, rtol=0)
            torch.testing.assert_close(traj.next_latents[b, s].double(), x1, atol=1e-6, rtol=0)
            # float32 log-probs near -8.5 (4x noise) carry ~1e-6 of rounding: 1e-6 relative there
            assert abs(float(traj.log_probs[b, s]) - float(logp)) <= 1e-6 * max(1.0, abs(float(logp)))
        torch.testing.assert_close(traj.final[b].double(), leaf["x0"], atol=1e-6, rtol=0)  # dance decodes x0
    rewards = torch.rand(2 * group, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    leaf_adv, _ = group_advantages(rewards, traj.group_index)
    got = tree_advantages(leaf_adv, traj.group_index, traj.step_nodes)
    for p in range(2):
        tree = slice(p * group, (p + 1) * group)
        # the reference's node averages of the same leaf values (fgrpo's leaves carry their group advantages)
        torch.testing.assert_close(
            got[tree], naive_tree_advantages(leaf_adv[tree], group, steps, splits), atol=1e-6, rtol=0
        )
        # of the raw rewards, as the reference: the z-scores agree up to its 1e-8, which acts in reward units
        # there and in advantage units here (node spreads of ~1e-2 make that ~1e-6)
        expected = naive_tree_advantages(rewards[tree], group, steps, splits)
        torch.testing.assert_close(got[tree], expected, atol=1e-5, rtol=0)


def test_split_noise_scale_widens_the_split_steps_only():
    """Same seed, scale 1 vs 4: the split step's action moves 4x as far from its mean; the log-prob
    is the unscaled Gaussian's (lower), and a step off the split points is unchanged at the root."""
    policy = GaussianPolicy(shape=(64,))
    one, four = (
        rollout(registry.create("sampler", "branch", steps=4, split_points=[1], split_noise_scale=k), policy, 2, 3)
        for k in (1.0, 4.0)
    )
    assert torch.equal(one.next_latents[:, 0], four.next_latents[:, 0])
    torch.testing.assert_close(
        four.next_latents[:, 1] - four.means[:, 1], 4 * (one.next_latents[:, 1] - one.means[:, 1]), atol=1e-5, rtol=0
    )
    assert bool((four.log_probs[:, 1] < one.log_probs[:, 1]).all())


# --- pruning -------------------------------------------------------------------------------------


def test_depth_pruning_leaves_out_its_depths_and_slides_up_to_the_stop_depth():
    """Depths 5 and 6 of 6 steps (the edges of steps 4 and 5), sliding every 2 iterations, stopping
    at the last split (3); the reference's step is fgrpo's iteration + 1, moved (step // 2) times:
    iteration 0 -> {5, 6}, 1 and 2 -> {4, 5}, 3 and later -> {3, 4}."""
    policy = GaussianPolicy(shape=(2,))
    sampler = registry.create(
        "sampler",
        "branch",
        steps=6,
        split_points=[1, 3],
        depth_pruning=[5, 6],
        depth_pruning_slide=True,
        depth_pruning_slide_interval=2,
    )
    expected = {0: [0, 1, 2, 3], 1: [0, 1, 2, 5], 2: [0, 1, 2, 5], 3: [0, 1, 4, 5], 40: [0, 1, 4, 5]}
    for it, trained in expected.items():
        sampler.advance(it)
        traj = rollout(sampler, policy, 4, it)
        assert traj.step_index[0].tolist() == trained, f"iteration {it}"
    fixed = registry.create("sampler", "branch", steps=6, split_points=[1, 3], depth_pruning=[1, 6])
    fixed.advance(100)
    assert rollout(fixed, policy, 4, 0).step_index[0].tolist() == [1, 2, 3, 4]


def naive_width_pruning_mode_1(rewards, group, steps, splits, ratio):
    """The reference's ``width_pruning_mode`` 1 on one tree, literally: the edges collected depth first
    (``collect_all_transitions``), those whose parent step is after the last split grouped by the
    node they descend from at step last + 1, each group sorted by advantage (descending, stable) and
    cut to max(1, int(n * ratio)). Returns the kept edges as (step, node index at depth step + 1)."""
    adv = naive_tree_advantages(rewards, group, steps, splits)

    def width(depth):
        return 2 ** sum(1 for s in splits if s < depth)

    samples = []

    def collect(step, node, branch):  # the edges below the node at depth ``step``
        if step == steps:
            return
        for child in (2 * node, 2 * node + 1) if step in splits else (node,):
            size = group // width(step + 1)
            below = child if step + 1 == max(splits) + 1 else branch
            samples.append({"step": step, "node": child, "adv": float(adv[child * size, step]), "branch": below})
            collect(step + 1, child, below)

    collect(0, 0, None)
    last = max(splits)
    others = [x for x in samples if x["step"] <= last]
    branches: dict = {}
    for x in samples:
        if x["step"] > last:
            branches.setdefault(x["branch"], []).append(x)
    kept = list(others)
    for members in branches.values():
        ordered = sorted(members, key=lambda x: x["adv"], reverse=True)
        kept += ordered[: max(1, int(len(members) * ratio))]
    return {(x["step"], x["node"]) for x in kept}


@pytest.mark.parametrize(("steps", "splits", "ratio"), [(10, [0, 3, 6], 0.5), (8, [1, 2], 0.3), (6, [0, 1], 1.0)])
def test_width_pruning_mode_1_keeps_the_references_edges(steps, splits, ratio):
    group = 2 ** len(splits)
    sampler = registry.create(
        "sampler", "branch", steps=steps, split_points=splits, width_pruning=1, width_pruning_ratio=ratio
    )
    traj = rollout(sampler, GaussianPolicy(shape=(2,)), group, 0, prompts=PROMPTS[:1])
    trained = traj.step_index[0].tolist()
    ours = {
        (trained[c], int(traj.step_nodes[b, c]))
        for b in range(group)
        for c in range(len(trained))
        if traj.policy_weight[b, c] == 1
    }
    for seed in range(3):
        rewards = torch.rand(group, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert ours == naive_width_pruning_mode_1(rewards, group, steps, splits, ratio)


def test_group_size_must_be_the_leaf_count():
    sampler = registry.create("sampler", "branch", steps=6, split_points=[0, 2])
    with pytest.raises(ValueError, match="2 \\*\\* len\\(split_points\\)"):
        rollout(sampler, GaussianPolicy(), 8, 0)
    with pytest.raises(ValueError, match="power of two"):
        rollout(registry.create("sampler", "branch", steps=6), GaussianPolicy(), 3, 0)


# --- fgrpo check and resume ----------------------------------------------------------------------

BRANCH = "sampler={name: branch, steps: 10, depth_pruning: [9, 10], depth_pruning_slide: true, " + (
    "depth_pruning_slide_interval: 2, kernel: {name: dance, eta: 0.3}}"
)


def test_validate_refuses_a_group_size_that_is_not_the_leaf_count(root, capsys):
    recipe = str(root / "recipes" / "vector.yaml")
    assert cli.main(["validate", recipe, "--set", BRANCH, "--set", "train.group_size=6"]) != 0
    assert "train.group_size" in capsys.readouterr().err


def test_check_passes_on_the_vector_recipe(root, capsys):
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), "--set", BRANCH]) == 0
    assert "on-policy check passed" in capsys.readouterr().out


def test_check_passes_on_the_shapes_branch_recipe(root, capsys):
    recipe = str(root / "recipes" / "shapes-branch.yaml")
    assert cli.main(["validate", recipe]) == 0
    assert cli.main(["check", recipe, "--set", "train.prompts_per_iteration=2"]) == 0
    assert "on-policy check passed" in capsys.readouterr().out


def test_stop_and_resume_is_bit_exact(root, tmp_path):
    """Stopped after iteration 5 with the checkpoint of iteration 3 as the newest, then resumed (the
    pruned depths slide meanwhile): the weights and every metric equal an uninterrupted run's."""
    sets = ["--set", BRANCH, "--set", "train.iterations=8", "--set", "train.checkpoint_every=3"]
    sets += ["--set", "eval.every=4", "--set", "log.plots=false", "--set", "log.trackers=[]", "--quiet"]
    a, b = stop_and_resume(root / "recipes" / "vector.yaml", tmp_path, sets, stop=5, newest=3)
    assert_same_training(a, b)
    assert len(metric_rows(a)) >= 8

"""The contracts between fgrpo's components.

Components are plain classes (attrs classes whose fields are the recipe keys); they satisfy these
protocols structurally, nothing inherits from them. The trainer only ever talks to a component
through the methods named here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, TypeVar, Union, runtime_checkable

import attrs
import torch

#: Conditioning produced by ``Policy.encode``: a tensor or a (nested) dict/tuple of tensors whose
#: first dimension is the batch. ``fgrpo.core.tensors`` repeats, indexes and concatenates it along
#: dimension 0; nothing without a batch dimension travels in it (see ``Policy``).
Cond = Any


@attrs.frozen
class KernelStep:
    """What one transition sigmas[index] -> sigmas[index + 1] produced (float32 throughout).

    - ``prev_sample``: the next state x' (the given ``prev_sample`` when only evaluating).
    - ``mean``: the Gaussian mean mu(x, v).
    - ``std``: the per-step standard deviation, broadcastable to the sample (zero for ODE steps).
    - ``log_prob``: shape (batch,), the Gaussian log-density of x' averaged over non-batch dims.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


@attrs.frozen
class ForwardGroups:
    """A policy's optional ``forward_groups`` (see :class:`Policy`): its rows run through one of
    several networks chosen by their noise level (Wan 2.2 A14B's high- and low-noise experts).

    - ``of(sigma)``: (B,) int64, the group of each row at noise level ``sigma`` (B,); one
      ``velocity`` call makes one forward per group present, in increasing group order;
    - ``levels``: a noise level of each group (``of(torch.tensor(levels))`` is 0, 1, ...), at which
      a padding pass of that group evaluates.
    """

    of: Callable[[torch.Tensor], torch.Tensor]
    levels: tuple[float, ...]


@runtime_checkable
class Kernel(Protocol):
    """One step of a sampler; ``stochastic`` kernels have a std and a log-prob and can be trained.

    ``index`` is an int or a LongTensor of shape (batch,) (per-sample step indices).
    With ``prev_sample`` given nothing is sampled: only the log-prob of that action is evaluated.

    Optional class attributes the built-in samplers and objectives read: ``reference_final``
    (what a sampler decodes by default: 'sample' or 'x0', the kernel's reference implementation's
    choice) and ``brownian`` (the step's std is g sqrt(-dt), so flow_grpo's KL form applies).
    """

    # Read-only members are properties here, so a class attribute, an attrs field or a property
    # all satisfy them (a bare annotation would ask for a settable instance variable).
    @property
    def stochastic(self) -> bool: ...

    def step(
        self,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        index: int | torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> KernelStep: ...


@runtime_checkable
class Policy(Protocol):
    """A flow-matching generator with trainable parameters.

    ``velocity`` predicts v = eps - x0 at noise level ``sigma`` (shape (batch,)) for the
    conditioning ``cond`` (batch-first, as returned by ``encode``; classifier-free guidance, if
    any, is applied inside), as float32 in the layout of ``x``. ``reference()`` is a context in
    which ``velocity`` is the frozen reference policy (LoRA adapters disabled) without a second
    copy of the network. ``sigmas(steps)`` is the model's own default schedule (length steps + 1,
    from 1 down to 0); ``evaluations_per_call`` is the NFE one ``velocity`` call costs (2 with
    classifier-free guidance), so samplers count NFE honestly. ``decode`` gives the outputs
    rewards score: images (B, 3, H, W) or videos (B, T, 3, H, W) as float32 in [0, 1], or the
    policy's own tensors.

    How tensors travel: every tensor in ``cond`` has the batch as its first dimension, because
    the trainer repeats it per group, indexes (sample, step) pairs out of it and concatenates
    rollout chunks along dimension 0. Tensors that have no batch dimension (FLUX's image and
    text position ids, rotary tables, Qwen-Image's image shapes) never go into ``cond``: the
    policy derives them inside ``velocity`` from the shapes of ``x`` and ``cond`` (and may
    cache them). Per-sample data of varying length is padded to a fixed width with a mask in
    ``cond`` (Qwen-Image pads prompt embeddings to ``max_sequence_length`` and trims each
    forward to its longest prompt), so batches from different calls can be concatenated.

    Optional: ``export(folder, state=None)`` writes the trained weights in the backbone's own
    format (the ``fgrpo export`` command), and ``export_in_checkpoints`` (true) puts that export
    into every checkpoint: the trainer then passes ``state``, a ``trainable_state_dict()`` of the
    weights evaluation uses, to write instead of reading the module. With it, the static
    ``start_from(folder)`` gives the model keys that make a new policy start from what ``export``
    wrote into ``folder`` (its base, and its reference): a recipe's later stages (``then:``,
    :mod:`fgrpo.core.stages`) need it.

    Optional, for policies conditioned on images (editing, image-to-video): a prompt is then a
    :class:`fgrpo.core.media.Prompt`, a ``str`` that carries its source images (``prompt.images``,
    read with :func:`fgrpo.core.media.load_image`), and ``encode(prompts)`` turns text and images
    into batch-first tensors of ``cond``. Its identity is (text, images), so whatever is cached,
    grouped, chunked or resumed by prompt stays valid. The class attribute
    ``source_image_count = (least, most)`` says how many images a prompt must carry (absent:
    (0, 0), text only); a mismatch is refused at validation and before the first rollout. A policy
    that reads more of a prompt's row first receives the prompt source's ``metadata`` through
    ``use_prompt_metadata(lookup)``; ``check_prompts(prompts)`` says which prompts it cannot take.

    Optional, for sharded runs (FSDP and DeepSpeed launches, :mod:`fgrpo.core.launch`):
    ``trainable_module`` is the ``nn.Module`` that holds every trainable parameter and that
    ``velocity`` calls (through its ``__call__``) for each forward, e.g. the transformer; FSDP
    shards it in place, so its parameters become DTensor shards; DeepSpeed ZeRO-3 partitions its
    weights in place and the trainer calls the two state-dict methods with them gathered whole.
    ``trainable_state_dict`` then returns whole tensors (every process calls it) and
    ``load_trainable_state_dict`` takes whole tensors. A policy whose network depends on the noise
    level (Wan 2.2's two experts) says so with ``forward_groups`` (a :class:`ForwardGroups`; absent
    or None: one network for every row): where every process takes part in each forward or
    backward, the update then makes every pass of one group only, and every process the same
    groups in the same order (:mod:`fgrpo.core.points.lockstep`).
    """

    # a recipe key typed as the recipe gives it ('cpu', 'auto', ...); built-ins resolve it to a
    # torch.device when they are built
    @property
    def device(self) -> torch.device | str: ...

    @property
    def evaluations_per_call(self) -> int: ...

    def encode(self, prompts: Sequence[str]) -> Cond: ...

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor: ...

    def sigmas(self, steps: int) -> torch.Tensor: ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]: ...

    def reference(self) -> AbstractContextManager[None]: ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


class Exporting(Protocol):
    """A policy's optional ``export`` (see :class:`Policy`): the trained weights, or the given
    ``trainable_state_dict()``, written in the backbone's own format into ``folder``; the files written."""

    def export(self, folder: str, state: Mapping[str, torch.Tensor] | None = None) -> Iterable[str]: ...


@attrs.define
class Trajectory:
    """A group rollout: B = prompts x group_size samples, S trained steps each.

    Everything the update needs to re-evaluate log-probs of the stored actions: the state before
    (``latents``) and after (``next_latents``) every trained step, the old log-probs, means and
    stds, and which step of ``sigmas`` each one was.
    """

    prompts: list[str]  # (B,) the prompt of every sample
    group_index: torch.Tensor  # (B,) long: samples with the same value share a prompt
    cond: Cond  # (B, ...) conditioning, batch-first
    sigmas: torch.Tensor  # (T + 1,) the schedule used
    step_index: torch.Tensor  # (B, S) long: index into sigmas of every trained step
    latents: torch.Tensor  # (B, S, *shape) x before each trained step
    next_latents: torch.Tensor  # (B, S, *shape) x' after each trained step (the action)
    log_probs: torch.Tensor  # (B, S) float32
    means: torch.Tensor  # (B, S, *shape) float32 mean at sampling time (GRPO-Guard needs it)
    stds: torch.Tensor  # (B, S) float32 per-step std (scalar per sample and step)
    final: torch.Tensor  # (B, *shape) the final latents
    outputs: Any = None  # decoded outputs, filled by the trainer (images (B, 3, H, W) in [0, 1])
    nfe: int = 0  # network evaluations spent on this rollout (CFG doubling included)
    info: dict[str, Any] = attrs.Factory(dict)
    policy_weight: torch.Tensor | None = (
        None  # (B, S) the policy loss's weight per step; 0: KL only (kl_steps: all); None: 1
    )
    #: (B,) long: each sample's id over the whole batch of every process (its prompt's global slot x
    #: group_size + its place in the group), set by the trainer's rollout; None straight from a sampler
    sample_ids: torch.Tensor | None = None
    #: (B, S) long: the node of its prompt's tree each trained transition leads to, numbered within the
    #: tree (a tree sampler, ``branch``); the step's advantage is then its node's, normalised among the
    #: nodes of its depth (:func:`fgrpo.core.advantages.tree_advantages`). None: the sample's advantage
    step_nodes: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def num_trained_steps(self) -> int:
        return int(self.step_index.shape[1])


@runtime_checkable
class Sampler(Protocol):
    """Runs group rollouts under no_grad; owns its kernel (``sampler.kernel``) and its state.

    Optional: ``sigmas(policy, steps) -> Tensor``, the schedule the sampler samples on for
    ``steps`` steps; evaluation integrates on it (else on ``policy.sigmas(steps)``).
    """

    @property
    def kernel(self) -> Kernel: ...

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory: ...

    def advance(self, iteration: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@attrs.define
class RewardResult:
    """``scores``: float tensor (B,); ``details``: named per-sample tensors or lists (logged).

    Float (and bool) details are averaged into evaluation metrics, per ``category`` too when the
    reward gives one (a list of str); ``read``, a list of str, says what the reward read in each
    output (a verifier's parse) and is shown under the images of sample grids and the report."""

    scores: torch.Tensor
    details: dict[str, Any] = attrs.Factory(dict)


@runtime_checkable
class Reward(Protocol):
    """Scores finished samples in batches. Images are float (B, 3, H, W) in [0, 1].

    Videos (B, T, 3, H, W) reach a reward as images, frame by frame (every ``frame_stride``-th
    frame, a key of the reward's recipe entry), and a video's score is the mean of its frames'
    (``fgrpo.core.scoring.score_frames``); a reward that scores whole videos itself declares the
    class attribute ``accepts_video = True`` and receives the (B, T, 3, H, W) tensor.

    The group-aware form: a reward that judges the samples of a prompt group jointly (pairwise
    win rates, within-group ranks) declares ``groupwise = True`` and is called with the keyword
    ``groups``, a (B,) long tensor in which samples of the same prompt group share a value (the
    batch always holds whole groups: a training batch its G samples per prompt, an evaluation its
    ``eval.samples_per_prompt``).

    Edits: a reward that compares each output with the images its prompt started from declares
    ``accepts_sources = True`` and is called with the keyword ``sources``: per sample, a tuple of
    float32 (3, H, W) tensors in [0, 1] at the outputs' size (empty for a prompt without sources;
    :func:`fgrpo.core.media.reward_sources`). Prompts are strings; one with sources is a
    :class:`fgrpo.core.media.Prompt` (``prompt.images`` names them; ``metadata`` is its row).
    """

    def __call__(
        self, outputs: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult: ...


@attrs.define
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, carries gradient
    metrics: dict[str, torch.Tensor]  # detached scalars


@attrs.frozen
class StepBatch:
    """One trained step for a minibatch of samples, as the objective sees it.

    ``log_prob``/``mean`` are recomputed under the current policy (with gradient);
    ``old_*`` come from the rollout. ``ref_mean``/``ref_velocity`` are filled only when the
    objective asks for a reference (``Objective.needs_reference``).
    """

    log_prob: torch.Tensor  # (b,)
    old_log_prob: torch.Tensor  # (b,)
    advantages: torch.Tensor  # (b,)
    mean: torch.Tensor  # (b, *shape)
    old_mean: torch.Tensor  # (b, *shape)
    std: torch.Tensor  # (b,)
    dt: torch.Tensor  # (b,) sigma' - sigma (< 0)
    velocity: torch.Tensor | None = None  # (b, *shape)
    ref_mean: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None


@attrs.frozen
class ForwardBatch:
    """Forward-process training points for a minibatch, as the objective sees them.

    Every row is a finished sample ``x0`` re-noised at ``t``: ``x_t = (1 - t) x0 + t noise``, whose
    flow-matching target is ``noise - x0``. ``velocity`` is the current policy's prediction at
    (x_t, t) with gradient; ``old_velocity`` the objective's old policy's (no gradient; only when
    the objective keeps one, ``Objective.old_decay``), ``ref_velocity`` the adapter-disabled
    reference's (only when ``needs_reference``). A pairwise objective (``pairwise = True``) gets
    2m rows: row i and row m + i are the preferred and the rejected sample of one pair, drawn at
    the same t with the same noise.
    """

    advantages: torch.Tensor  # (b,) the sample's advantage (pairs: +1 preferred, -1 rejected)
    t: torch.Tensor  # (b,) noise level in (0, 1]
    x0: torch.Tensor  # (b, *shape) the finished sample
    noise: torch.Tensor  # (b, *shape)
    x_t: torch.Tensor  # (b, *shape)
    velocity: torch.Tensor  # (b, *shape) float32, with gradient
    old_velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None
    #: (b,) for a grouped objective (``grouped = True``): rows with one id are one prompt group's
    #: samples at one shared (t, noise); None elsewhere
    groups: torch.Tensor | None = None

    @property
    def target(self) -> torch.Tensor:
        """The flow-matching target ``noise - x0``."""
        return self.noise - self.x0


#: what an objective trains on: the stored transitions of a rollout's stochastic steps (a
#: :class:`StepBatch`), or its finished samples re-noised on the forward process (a :class:`ForwardBatch`)
TrainsOn = Literal["transitions", "forward"]
BatchT_contra = TypeVar("BatchT_contra", bound="StepBatch | ForwardBatch", contravariant=True)


@runtime_checkable
class Objective(Protocol[BatchT_contra]):
    """Turns a batch of training points into a loss; it declares what it trains on and what the
    update must compute for it (typed members: :class:`fgrpo.core.objectives.base.TransitionObjective`
    and :class:`~fgrpo.core.objectives.base.ForwardProcessObjective` give their defaults):

    - ``trains_on``: ``"transitions"`` (a :class:`StepBatch`; grpo, grpo-guard) or ``"forward"``
      (a :class:`ForwardBatch`; nft, awm, dpo), one update loop serves both;
    - ``needs_reference``: the adapter-disabled reference's predictions are computed (a KL);
    - ``needs_old``: it keeps an old policy (a lagged copy of the trained weights; then
      ``old_decay``), ``samples_from_old``: rollouts come from that old policy (DiffusionNFT);
    - ``pairwise``: it trains on (preferred, rejected) pairs of samples of one group (``pairs``);
    - optionally ``idle_iterations`` (0 when absent): the run's first iterations only spend their
      prompts (no rollout, no update; AWM's reference idles two epochs).
    """

    @property
    def trains_on(self) -> TrainsOn: ...

    @property
    def needs_reference(self) -> bool: ...

    @property
    def needs_old(self) -> bool: ...

    @property
    def samples_from_old(self) -> bool: ...

    @property
    def pairwise(self) -> bool: ...

    def __call__(self, batch: BatchT_contra) -> ObjectiveOutput: ...


class ForwardObjective(Objective[ForwardBatch], Protocol):
    """What the forward-process update also calls on an objective with ``trains_on = "forward"``:
    ``point_times(sigmas, generator) -> (K,)``, the noise levels of one item's K training points
    (``sigmas``: the rollout's schedule) drawn from ``generator``, which then draws their noise;
    ``pairs(advantages, groups) -> (P, 2)`` (only when ``pairwise``) and
    ``old_decay(optimizer_steps)`` (only when ``needs_old``: after every iteration the old policy
    moves to decay x old + (1 - decay) x current)."""

    def point_times(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor: ...

    def pairs(self, advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor: ...

    def old_decay(self, optimizer_steps: int) -> float: ...


#: an objective of either kind, as a run holds it
AnyObjective = Union[Objective[StepBatch], ForwardObjective]  # noqa: UP007 - a runtime alias on Python 3.10


@runtime_checkable
class PromptSource(Protocol):
    """Train and test prompts (with optional per-prompt metadata for the reward). A prompt that
    starts from source images is a :class:`fgrpo.core.media.Prompt`.

    Optional: the classmethod ``listed_prompts(keys) -> prompts`` lists every prompt from the
    recipe keys without building the source, so validation can refuse prompts the model cannot
    take (the built-in sources have it)."""

    def train_prompts(self) -> list[str]: ...

    def test_prompts(self) -> list[str]: ...

    def metadata(self, prompt: str) -> Mapping[str, Any]: ...


@attrs.frozen
class EvalContext:
    """What an evaluator gets at an evaluation (``fgrpo.core.evaluation``).

    - ``policy``: the policy as evaluation uses it (its EMA weights swapped in when the run keeps
      one), under no_grad; an evaluator may call it as often as it likes (roll out, replan).
    - ``prompts``: the held-out prompts (``eval.max_prompts`` applied), ``metadata(prompt)`` the
      prompt source's metadata of each.
    - ``generate(prompts, per_prompt, generator)``: the evaluation's deterministic sampler (Euler
      steps of the flow ODE on the sampler's schedule with ``eval.steps`` steps): the decoded
      outputs, ``per_prompt`` per prompt, prompt-major.
    - ``samples`` / ``sample_prompts``: what the evaluation already generated and scored with the
      rewards (``eval.samples_per_prompt`` per prompt, the same noise at every evaluation), for
      evaluators that judge those very samples.
    - ``seed`` / ``iteration``: an evaluator that draws anything seeds it from these (the same
      draws at every evaluation: ``fgrpo.core.seeding.generator(seed, ...)``).
    """

    policy: Any
    prompts: list[str]
    metadata: Callable[[str], Mapping[str, Any]]
    generate: Callable[..., Any]
    samples: Any
    sample_prompts: list[str]
    seed: int
    iteration: int
    device: Any = None


@attrs.define
class Picture:
    """One picture an evaluator shows in the report (a filmstrip row per ``prompt``): float
    (3, H, W) in [0, 1], a score, a caption line (``read``) and, where the world has a pass rule,
    its verdict (``passed``: the report's badge then says pass or fail, not the score alone)."""

    prompt: str
    image: torch.Tensor
    score: float | None = None
    read: str = ""
    passed: bool | None = None


@attrs.define
class EvaluatorResult:
    """``metrics``: scalars logged as ``gold/<label>/<key>``; a key ``name/category`` is the
    metric per category (a scenario type), drawn per category by the report. ``pictures``: shown
    in the report's gold filmstrip."""

    metrics: dict[str, float]
    pictures: list[Picture] = attrs.Factory(list)


@runtime_checkable
class Evaluator(Protocol):
    """A gold metric: run at evaluation with the policy on held-out prompts; RL never optimises
    it (it may roll out, replan, simulate, read the evaluation's samples). Its metrics are logged
    as ``gold/<label>/...``, drawn against the proxy reward in the report, and watched by the
    over-optimisation guard (``eval.guard``).

    Optional class attribute ``directions``: ``{metric: "higher" | "lower"}``, which way is
    better for each metric (the guard and the report read it; default higher)."""

    def __call__(self, context: EvalContext) -> EvaluatorResult: ...

"""``vlm-judge``: a vision-language model judges each image over an OpenAI-compatible chat API.

This is how UnifiedReward, Qwen2.5-VL and similar judges are served (vLLM, sglang, or any server
with ``POST /v1/chat/completions``). Each image goes inline as a base64 data URL beside the
prompt template; the answer is parsed into a number (``parse: number``) or a yes/no (``parse:
yes-no``: the probability of "yes" from the first token's logprobs when the server gives them, else
1/0 from the text), or, as the judge of a ``pairwise`` reward, compares two images (``parse:
pairwise``: Pref-GRPO's "Image 1 is better" / "Image 2 is better" inside <answer>). Requests run
``concurrency`` at a time, each with a timeout and retries with exponential backoff (``timeout``
bounds each request as a whole), and answers larger than ``max_answer_mb`` are refused unread. An
answer that cannot be parsed is an error, unless
``fallback`` is set: then that value is used, a warning is logged, and the sample's
``fallback`` detail is 1 (its mean is logged every iteration as ``reward/LABEL/fallback`` and by
evaluation). The standard library only.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
from PIL import Image

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.visuals import to_uint8
from fgrpo.rewards.http import ServiceError, post, token_from_env

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are shown an image generated from the caption below. Judge (1) how faithfully the image "
    "follows the caption: objects, counts, attributes and relations; and (2) its visual quality: "
    "sharpness, detail, colour and composition. Reply with a short justification, then a score "
    "from 1 (poor) to 5 (excellent) written as 'Final Score: N'.\nCaption: {prompt}"
)
YES_NO_TEMPLATE = "Does this image show: {prompt}? Answer yes or no."
#: Pref-GRPO's UnifiedReward-Think comparison (CodeGoat24/Pref-GRPO fastvideo/rewards/templates.py:172-235
#: at 3e787f6), shortened to its instructions: two images, a verdict inside <answer></answer>
PAIRWISE_TEMPLATE = (
    "You are an objective and precise evaluator for image quality comparison. I will provide you with a text "
    "caption and two images generated based on this caption. You must analyze the two images carefully and "
    "determine which image is better.\n\nThe caption for the generated images is: 「{prompt}」. Evaluate the two "
    "images on semantic consistency (how closely the image content aligns with the caption), aesthetics "
    "(composition, color usage, artistic expression) and authenticity (realism and attention to detail); score "
    "each image 1-10 on each dimension with a short rationale and total the scores, all inside <think> and "
    "</think>. After </think>, output the final judgment strictly inside <answer> and </answer> tags, containing "
    "only one of:\n- Image 1 is better\n- Image 2 is better"
)
#: edits (the source image first, then the edited one): instruction following and preservation
EDIT_TEMPLATE = (
    "You are shown two images: the first is the original, the second is the result of editing it with the "
    "instruction below. Judge (1) how well the edit carries out the instruction, and (2) how well everything the "
    "instruction does not ask to change is preserved: objects, layout, identity, colours and style. Reply with a "
    "short justification, then a score from 1 (poor) to 5 (excellent) written as 'Final Score: N'.\nInstruction: "
    "{prompt}"
)
EDIT_YES_NO_TEMPLATE = (
    "The first image is the original, the second the result of editing it. Was the edit '{prompt}' carried out, "
    "with everything else left as it was? Answer yes or no."
)


class Unparsable(ValueError):
    """The judge answered something that holds no score."""


def parse_number(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    if match is None:
        raise Unparsable(f"no match for {pattern!r} in {text[:200]!r}")
    return float(match.group(1) if match.groups() else match.group(0))


def _word(token: str) -> str:
    return token.strip().strip(".,!:;\"'").lower()


def parse_yes_no(text: str, logprobs: Any) -> float:
    """P(yes) among the first token's top alternatives that read yes or no; else 1/0 from the text."""
    try:
        first = logprobs["content"][0]["top_logprobs"]
        yes = sum(math.exp(t["logprob"]) for t in first if _word(t["token"]) == "yes")
        no = sum(math.exp(t["logprob"]) for t in first if _word(t["token"]) == "no")
        if yes + no > 0:
            return yes / (yes + no)
    except (KeyError, IndexError, TypeError):
        pass
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] in ("yes", "no"):
        return 1.0 if words[0] == "yes" else 0.0
    raise Unparsable(f"no yes/no answer in {text[:200]!r}")


def parse_verdict(text: str, answer_pattern: str, first: str, second: str) -> float:
    """1 when the answer says the first image is better, 0 the second (Pref-GRPO's
    ``_pairwise_win_rate``: the text inside <answer></answer>); anything else is unparsable."""
    match = re.search(answer_pattern, text, re.DOTALL)
    verdict = (match.group(1) if match and match.groups() else match.group(0) if match else "").strip()
    if first in verdict:
        return 1.0
    if second in verdict:
        return 0.0
    raise Unparsable(f"no verdict ({first!r} or {second!r}) in {text[:200]!r}")


def data_url(image: Any, fmt: str, size: int) -> str:
    """A uint8 (H, W, 3) array as a base64 data URL, resized to size x size when size > 0."""
    picture = Image.fromarray(image)
    if size:
        picture = picture.resize((size, size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG" if fmt == "jpeg" else "PNG", **({"quality": 95} if fmt == "jpeg" else {}))
    mime = "jpeg" if fmt == "jpeg" else "png"
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@attrs.define
class VLMJudge:
    """score = the judge's parsed answer / divisor (number), or P(yes) (yes-no). Details:
    ``answer`` (the raw text), ``fallback`` (1 where the fallback value was used).

    Edits: a prompt with source images (an editing backbone's) is judged on its sources and the
    output, sent in that order, with ``edit_template`` (instruction following and preservation);
    the reward takes them as ``sources`` (``accepts_sources``)."""

    accepts_sources = True

    model: str = param(
        help="the model name the server serves (e.g. UnifiedReward-7b-v1.5, Qwen/Qwen2.5-VL-7B-Instruct)"
    )
    url: str = param("http://127.0.0.1:8000/v1", help="base URL of the OpenAI-compatible API (…/v1)")
    api_key_env: str | None = param("OPENAI_API_KEY", help="environment variable holding the API key; unset = no key")
    template: str | None = param(
        None,
        help="the question; {prompt} is the caption; none = a 1-5 judge (number), a yes/no question or Pref-GRPO's "
        "comparison (pairwise)",
    )
    edit_template: str | None = param(
        None,
        help="the question for edits (sources, then output); {prompt} is the instruction; none = a 1-5 judge of "
        "instruction following and preservation (number) or a yes/no question",
    )
    parse: str = param(
        "number",
        choices=("number", "yes-no", "pairwise"),
        help="how the answer becomes a score; pairwise: the judge compares two images "
        "(the judge of a pairwise reward)",
    )
    pattern: str = param(
        r"Final Score:\s*([-+]?\d+(?:\.\d+)?)", help="parse: number — a regex whose first group is the score"
    )
    divisor: float = param(
        5.0, gt=0, help="parse: number — the number is divided by this (flow_grpo's UnifiedReward: 5)"
    )
    image_format: str = param("png", choices=("png", "jpeg"), help="how images are encoded inline")
    image_size: int = param(512, ge=0, help="images are resized to this square size before sending; 0 = as generated")
    max_tokens: int = param(256, ge=1, help="longest answer asked for")
    temperature: float = param(0.0, ge=0, help="sampling temperature of the judge")
    concurrency: int = param(8, ge=1, help="requests in flight at once")
    timeout: float = param(60.0, gt=0, help="seconds one request may take in all (connect, send, the whole answer)")
    max_answer_mb: float = param(8.0, gt=0, help="a larger answer is refused unread (a chat completion is kilobytes)")
    retries: int = param(
        3, ge=0, help="retries of a request that failed to arrive (no connection, timeout, HTTP 429/5xx)"
    )
    backoff: float = param(1.0, ge=0, help="seconds before the first retry; doubled for each next one")
    answer_pattern: str = param(
        r"<answer>(.*?)</answer>",
        help="parse: pairwise — where the verdict is; its first group is searched for first_better / second_better",
    )
    first_better: str = param("Image 1 is better", help="parse: pairwise — the verdict for the first image")
    second_better: str = param("Image 2 is better", help="parse: pairwise — the verdict for the second image")
    fallback: float | None = param(
        None,
        help="score of an unparsable answer (pairwise: Pref-GRPO counts it a tie, 0.5); none = such an answer is an "
        "error",
    )
    _fallbacks: int = attrs.field(init=False, default=0, repr=False)

    def __attrs_post_init__(self) -> None:
        checked = {"number": ("pattern", self.pattern), "pairwise": ("answer_pattern", self.answer_pattern)}.get(
            self.parse
        )
        if checked is not None:
            try:
                re.compile(checked[1])
            except re.error as exc:
                raise ValueError(f"reward.{checked[0]}: {checked[1]!r} is not a regular expression: {exc}") from exc
        self.question("a caption")  # a template that cannot be filled fails when the reward is built
        self.question("an instruction", edit=True)

    @property
    def compares(self) -> bool:
        """Whether this judge compares two images (``compare``) rather than scoring one."""
        return self.parse == "pairwise"

    def question(self, prompt: str, edit: bool = False) -> str:
        if edit:
            key, template = (
                "edit_template",
                self.edit_template or (EDIT_TEMPLATE if self.parse == "number" else EDIT_YES_NO_TEMPLATE),
            )
        else:
            default = {"number": DEFAULT_TEMPLATE, "yes-no": YES_NO_TEMPLATE, "pairwise": PAIRWISE_TEMPLATE}[
                self.parse
            ]
            key, template = "template", self.template or default
        try:
            return template.format(prompt=prompt)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"reward.{key}: cannot fill {template!r} (only {{prompt}} is known; double other braces): {exc}"
            ) from exc

    def request(self, images: Any, prompt: str, sources: Sequence[Any] = ()) -> bytes:
        """The chat request for one image (comparing: a pair, first then second), after the
        images an edit started from."""
        pictures = [*sources, *(images if isinstance(images, tuple) else (images,))]
        body = {
            "model": self.model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        *[
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(p, self.image_format, self.image_size)},
                            }
                            for p in pictures
                        ],
                        {"type": "text", "text": self.question(prompt, edit=bool(sources))},
                    ],
                }
            ],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.parse == "yes-no":
            body.update(logprobs=True, top_logprobs=5)
        return json.dumps(body).encode()

    def ask(self, image: Any, prompt: str, sources: Sequence[Any] = ()) -> tuple[float | None, str]:
        """(score, answer text); score None when the answer holds none. ``sources``: the images an
        edit started from (uint8 arrays), sent before the output. Comparing, ``image`` is a pair
        and the score 1 when the first is better, 0 when the second."""
        headers = {"Content-Type": "application/json"}
        key = token_from_env(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        raw = post(
            self.url.rstrip("/") + "/chat/completions",
            self.request(image, prompt, sources),
            headers=headers,
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
            what=f"vlm-judge {self.model}",
            limit=int(self.max_answer_mb * 2**20),
        )
        try:
            choice = json.loads(raw)["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not text")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return None, f"<not a chat completion: {raw[:200]!r} ({exc})>"
        try:
            if self.parse == "number":
                return parse_number(text, self.pattern) / self.divisor, text
            if self.parse == "pairwise":
                return parse_verdict(text, self.answer_pattern, self.first_better, self.second_better), text
            return parse_yes_no(text, choice.get("logprobs")), text
        except Unparsable:
            return None, text

    def __call__(
        self,
        outputs: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        *,
        sources: Sequence[Any] | None = None,
    ) -> RewardResult:
        if self.parse == "pairwise":
            raise ValueError(
                "vlm-judge with parse: pairwise compares two images: make it the judge of a pairwise reward"
            )
        images = to_uint8(outputs)
        if len(images) != len(prompts):
            raise ValueError(f"vlm-judge got {len(images)} images for {len(prompts)} prompts")
        given = (
            [[to_uint8(s[None])[0] for s in row] for row in sources] if sources is not None else [[] for _ in prompts]
        )
        return self._answers(list(images), prompts, given)

    def compare(
        self, first: torch.Tensor, second: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        """Each (first[i], second[i]) pair judged once: score 1 when the first image is better, 0
        when the second (``parse: pairwise``; the pairwise reward calls this)."""
        if self.parse != "pairwise":
            raise ValueError(f"vlm-judge compares two images only with parse: pairwise (got parse: {self.parse})")
        a, b = to_uint8(first), to_uint8(second)
        return self._answers(list(zip(a, b, strict=True)), prompts, [[] for _ in prompts])

    def _answers(self, images: list[Any], prompts: Sequence[str], given: list[list[Any]]) -> RewardResult:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            answers = list(pool.map(self.ask, images, prompts, given))
        bad = [i for i, (score, _) in enumerate(answers) if score is None]
        if bad and self.fallback is None:
            i = bad[0]
            raise ServiceError(
                f"vlm-judge {self.model}: {len(bad)} of {len(prompts)} answers hold no score (sample {i}, prompt "
                f"{prompts[i]!r}: {answers[i][1][:200]!r}); set reward.fallback to score them instead"
            )
        if bad:
            self._fallbacks += len(bad)
            log.warning(
                "vlm-judge %s: %d of %d answers hold no score; scored %g (%d in this process so far)",
                self.model,
                len(bad),
                len(prompts),
                self.fallback,
                self._fallbacks,
            )
        scores = [self.fallback if s is None else s for s, _ in answers]
        return RewardResult(
            scores=torch.tensor(scores, dtype=torch.float32),
            details={
                "answer": [text for _, text in answers],
                "fallback": torch.tensor([float(s is None) for s, _ in answers]),
            },
        )

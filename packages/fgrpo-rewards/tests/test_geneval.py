"""geneval: GenEval's rules on hand-labelled detections (a stub detector), and the real loading and
detection plumbing on tiny random OWLv2 and Mask2Former detectors with a tiny CLIP."""

from __future__ import annotations

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.scoring import detail_means
from fgrpo.core.testing import RewardConformance
from fgrpo.rewards.geneval import (
    Detection,
    Verifier,
    judge,
    relative_position,
    select_objects,
    verdict_result,
)

LEFT, RIGHT = (0, 40, 20, 60), (60, 40, 80, 60)
TOP, BOTTOM = (40, 0, 60, 20), (40, 60, 60, 80)


def det(label, box=(10, 10, 30, 30), score=0.95):
    return Detection(label, score, tuple(float(v) for v in box))


def objects(*dets):
    return select_objects(list(dets), threshold=0.3, max_objects=16, nms_threshold=1.0)


def colours(mapping):
    return lambda cls: list(mapping.get(cls, []))


def meta(tag, include, exclude=()):
    return {"tag": tag, "include": list(include), "exclude": list(exclude)}


# --- relative position -------------------------------------------------------------------------


def test_relative_position_by_hand():
    assert relative_position(LEFT, RIGHT) == {"left of"}
    assert relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position(TOP, BOTTOM) == {"above"}  # image y grows downwards
    assert relative_position(BOTTOM, TOP) == {"below"}
    assert relative_position(LEFT, LEFT) == set()
    # diagonal at 45 degrees: |dx| = |dy| = 0.707 of the offset after no shrinking -> both hold
    assert relative_position((0, 0, 0, 0), (10, 10, 10, 10), threshold=0.0) == {"left of", "above"}
    # boxes 20 wide, centres 25 apart: margin 0.1 x 40 = 4 leaves 21 > half of 25 -> left of
    assert relative_position((0, 0, 20, 20), (25, 0, 45, 20)) == {"left of"}
    # a wide margin eats the offset: 0.7 x 40 = 28 > 25 -> no relation
    assert relative_position((0, 0, 20, 20), (25, 0, 45, 20), threshold=0.7) == set()


def test_select_objects_thresholds_orders_caps_and_suppresses():
    dets = [
        det("cat", score=0.5),
        det("cat", (11, 11, 31, 31), 0.9),
        det("cat", (50, 50, 70, 70), 0.31),
        det("cat", score=0.3),
        det("dog", score=0.99),
    ]
    kept = select_objects(dets, threshold=0.3, max_objects=16, nms_threshold=1.0)
    assert [d.score for d in kept["cat"]] == [0.9, 0.5, 0.31]  # 0.3 is not above 0.3
    assert len(kept["dog"]) == 1
    assert [d.score for d in select_objects(dets, 0.3, 2, 1.0)["cat"]] == [0.9, 0.5]
    # boxes (10..30) and (11..31) overlap by IoU 400/482 = 0.83: suppressed at 0.5, kept at 0.9
    assert [d.score for d in select_objects(dets, 0.3, 16, 0.5)["cat"]] == [0.9, 0.31]
    assert len(select_objects(dets, 0.3, 16, 0.9)["cat"]) == 3


# --- the verdicts on hand-labelled scenes ------------------------------------------------------

CASES = [
    # (metadata, detections, colours, (geneval, strict, partial))
    (meta("single_object", [{"class": "dog", "count": 1}]), [det("dog")], {}, (True, True, 1.0)),
    (meta("single_object", [{"class": "dog", "count": 1}]), [det("cat")], {}, (False, False, 0.0)),
    # GenEval takes >= count; flow_grpo's strict wants exactly count; partial 1 - |1 - 2| / 1 = 0
    (meta("single_object", [{"class": "dog", "count": 1}]), [det("dog"), det("dog", RIGHT)], {}, (True, False, 0.0)),
    # three dogs for one: partial 1 - 2 = -1 (flow_grpo's formula is not clipped)
    (meta("single_object", [{"class": "dog", "count": 1}]), [det("dog")] * 3, {}, (True, False, -1.0)),
    (
        meta("counting", [{"class": "chair", "count": 3}], [{"class": "chair", "count": 4}]),
        [det("chair")] * 2,
        {},
        (False, False, 1 - 1 / 3),
    ),
    (
        meta("counting", [{"class": "chair", "count": 3}], [{"class": "chair", "count": 4}]),
        [det("chair")] * 3,
        {},
        (True, True, 1.0),
    ),
    # four chairs for three: the exclusion fails GenEval; strict and partial see the count
    (
        meta("counting", [{"class": "chair", "count": 3}], [{"class": "chair", "count": 4}]),
        [det("chair")] * 4,
        {},
        (False, False, 1 - 1 / 3),
    ),
    (
        meta("two_object", [{"class": "tie", "count": 1}, {"class": "pizza", "count": 1}]),
        [det("tie")],
        {},
        (False, False, 0.5),
    ),
    (
        meta("colors", [{"class": "car", "count": 1, "color": "red"}]),
        [det("car")],
        {"car": ["red"]},
        (True, True, 1.0),
    ),
    (
        meta("colors", [{"class": "car", "count": 1, "color": "red"}]),
        [det("car")],
        {"car": ["blue"]},
        (False, False, 0.5),
    ),
    # missing car: count part 0 and one 0 for the colour
    (meta("colors", [{"class": "car", "count": 1, "color": "red"}]), [], {}, (False, False, 0.0)),
    (
        meta(
            "color_attr",
            [{"class": "laptop", "count": 1, "color": "red"}, {"class": "car", "count": 1, "color": "brown"}],
        ),
        [det("laptop"), det("car", RIGHT)],
        {"laptop": ["red"], "car": ["blue"]},
        (False, False, 0.75),
    ),
    (
        meta(
            "position",
            [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
        ),
        [det("teddy bear", LEFT), det("dog", RIGHT)],
        {},
        (True, True, 1.0),
    ),
    (
        meta(
            "position",
            [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
        ),
        [det("teddy bear", RIGHT), det("dog", LEFT)],
        {},
        (False, False, 2 / 3),
    ),
    # no target: the teddy's count part is 0, the dog's 1, its position 0
    (
        meta(
            "position",
            [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
        ),
        [det("dog", RIGHT)],
        {},
        (False, False, 1 / 3),
    ),
    (
        meta("position", [{"class": "cup", "count": 1}, {"class": "couch", "count": 1, "position": ["below", 0]}]),
        [det("cup", TOP), det("couch", BOTTOM)],
        {},
        (True, True, 1.0),
    ),
]


@pytest.mark.parametrize(("metadata", "dets", "colour_map", "expected"), CASES)
def test_hand_labelled_verdicts(metadata, dets, colour_map, expected):
    verdict = judge(objects(*dets), metadata, colours(colour_map))
    assert (verdict.geneval, verdict.strict) == expected[:2], verdict.reason
    assert verdict.partial == pytest.approx(expected[2])
    assert bool(verdict.reason) == (not expected[0])


def test_geneval_checks_colour_on_the_most_confident_objects_only():
    """Two cars asked, three found (GenEval keeps going): the two most confident must be red."""
    m = meta("counting", [{"class": "car", "count": 2, "color": "red"}])
    found = objects(det("car", score=0.9), det("car", RIGHT, 0.8), det("car", TOP, 0.7))
    assert judge(found, m, colours({"car": ["red", "red", "blue"]})).geneval
    assert not judge(found, m, colours({"car": ["red", "blue", "red"]})).geneval


class StubDetector:
    """Returns given detections; records which classes it was asked about."""

    def __init__(self, scenes):
        self.scenes, self.asked = scenes, []

    def __call__(self, images, classes):
        self.asked.append([list(c) for c in classes])
        return [self.scenes[int(img[0, 0, 0].item() * 10 + 0.5)] for img in images]


def test_verifier_uses_the_counting_threshold_for_counting_prompts():
    scenes = {0: [det("cat", score=0.5), det("cat", RIGHT, 0.95)]}
    stub = StubDetector(scenes)
    verifier = Verifier(stub, lambda image, dets, cls: ["red"] * len(dets), threshold=0.3, counting_threshold=0.9)
    images = torch.zeros(2, 3, 8, 8)
    metas = [
        meta("counting", [{"class": "cat", "count": 2}], [{"class": "cat", "count": 3}]),
        meta(
            "two_object", [{"class": "cat", "count": 2}, {"class": "dog", "count": 1}], [{"class": "bird", "count": 1}]
        ),
    ]
    counting, two = verifier.verdicts(images, metas)
    assert not counting.strict and counting.partial == pytest.approx(0.5)  # the 0.5 cat is not counted
    assert two.partial == pytest.approx(0.5)  # both cats count (0.5 > 0.3), no dog
    assert stub.asked == [[["cat"], ["cat", "dog", "bird"]]]


def test_verdict_result_feeds_per_category_means():
    verdicts = [judge(objects(*d), m, colours(c)) for m, d, c, _ in CASES]
    result = verdict_result(verdicts, [m["tag"] for m, *_ in CASES], "strict")
    torch.testing.assert_close(result.scores, result.details["strict"])
    means = detail_means(result.details)
    counting = [e for m, _, _, e in CASES if m["tag"] == "counting"]
    assert means["strict/counting"] == pytest.approx(sum(e[1] for e in counting) / len(counting))
    assert means["partial/position"] == pytest.approx((1 + 2 / 3 + 1 / 3 + 1) / 4)
    assert means["geneval"] == pytest.approx(sum(e[0] for *_, e in CASES) / len(CASES))
    tags = sorted({m["tag"] for m, *_ in CASES})  # GenEval's overall score: each task counts once
    assert len(tags) > 1
    assert means["geneval/overall"] == pytest.approx(sum(means[f"geneval/{t}"] for t in tags) / len(tags))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({}, "no GenEval 'tag'"),
        ({"tag": "x", "include": [{"class": "dog"}]}, "positive 'count'"),
        ({"tag": "x", "include": [{"class": "dog", "count": 1, "color": "mauve"}]}, "colour 'mauve'"),
        ({"tag": "x", "include": [{"class": "dog", "count": 1, "position": ["near", 0]}]}, "position"),
    ],
)
def test_bad_metadata_is_a_clear_error(bad, message):
    verifier = Verifier(StubDetector({0: []}), lambda *a: [])
    with pytest.raises(ValueError, match=message):
        verifier.verdicts(torch.zeros(1, 3, 8, 8), [bad])


# --- the real detectors, tiny and random -------------------------------------------------------

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")

METADATA = [
    meta("single_object", [{"class": "dog", "count": 1}]),
    meta("counting", [{"class": "cat", "count": 2}], [{"class": "cat", "count": 3}]),
    meta("colors", [{"class": "car", "count": 1, "color": "red"}]),
    meta("position", [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]),
]
PROMPTS = ["a photo of a dog", "a photo of two cats", "a photo of a red car", "a photo of a dog left of a cup"]


def scenes(size=64):
    return torch.rand(4, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def owl_folder(tmp_path_factory):
    from fgrpo.rewards.testing import save_tiny_owlv2

    return save_tiny_owlv2(tmp_path_factory.mktemp("tiny-owlv2"))


@pytest.fixture(scope="module")
def mask2former_folder(tmp_path_factory):
    from fgrpo.rewards.geneval import COCO_CLASSES
    from fgrpo.rewards.testing import save_tiny_mask2former

    favour = tuple(COCO_CLASSES.index(c) for c in ("dog", "cat", "car", "cup"))
    return save_tiny_mask2former(tmp_path_factory.mktemp("tiny-mask2former"), favour=favour)


# thresholds a random detector passes now and then, so that verdicts differ between samples
OWL = {"threshold": 0.0001, "counting_threshold": 0.0001, "score": "partial"}
M2F = {"threshold": 0.05, "counting_threshold": 0.05, "score": "partial"}


class TestGenEvalOwl(RewardConformance):
    reward_name = "geneval"

    @pytest.fixture
    def reward(self, owl_folder, clip_folder, offline):
        return registry.create(
            "reward", "geneval", detector=str(owl_folder), clip=str(clip_folder), device="cpu", **OWL
        )

    def make_inputs(self):
        return scenes(), list(PROMPTS), [dict(m) for m in METADATA]

    def test_scores_follow_the_detections(self, reward):
        """The verdicts are GenEval's rules applied to what the detector returned."""
        images = scenes()
        verifier = reward._verifier
        found = verifier.detector(images, [["dog"], ["cat"], ["car"], ["cup", "dog"]])
        assert any(found) and all(d.label in ("dog", "cat", "car", "cup") for ds in found for d in ds)
        result = reward(images, PROMPTS, METADATA)
        for b in range(4):
            limit = OWL["counting_threshold"] if METADATA[b]["tag"] == "counting" else OWL["threshold"]
            kept = select_objects(found[b], limit, 16, 1.0)

            def colour(cls, b=b, kept=kept):
                return verifier.colours(images[b], kept.get(cls, []), cls)

            expected = judge(kept, METADATA[b], colour)
            assert result.details["partial"][b].item() == pytest.approx(expected.partial)
            assert result.details["strict"][b].item() == float(expected.strict)
        assert result.details["category"] == [m["tag"] for m in METADATA]
        assert len(set(result.details["partial"].tolist())) > 1  # the order checks can see a shuffle


class TestGenEvalMask2Former(TestGenEvalOwl):
    @pytest.fixture
    def reward(self, mask2former_folder, clip_folder, offline):
        return registry.create(
            "reward", "geneval", detector=str(mask2former_folder), clip=str(clip_folder), device="cpu", **M2F
        )

    def test_scores_follow_the_detections(self, reward):
        found = reward._verifier.detector(scenes(), [[]] * 4)
        assert all(d.mask is not None and d.mask.shape == (64, 64) for ds in found for d in ds)
        labels = {d.label for ds in found for d in ds}
        assert labels and labels <= {"dog", "cat", "car", "cup"}  # GenEval's names of COCO ids 16, 15, 2, 41
        assert len(set(reward(scenes(), PROMPTS, METADATA).details["partial"].tolist())) > 1


def test_batch_equals_one_by_one(owl_folder, clip_folder, offline):
    reward = registry.create(
        "reward", "geneval", detector=str(owl_folder), clip=str(clip_folder), device="cpu", batch_size=4, **OWL
    )
    together = reward(scenes(), PROMPTS, METADATA).details["partial"]
    alone = torch.cat(
        [reward(scenes()[i : i + 1], PROMPTS[i : i + 1], METADATA[i : i + 1]).details["partial"] for i in range(4)]
    )
    torch.testing.assert_close(together, alone)


def test_colour_classifier_is_clips_zero_shot(clip_folder, offline):
    """The colour of a crop: argmax over the ten colours of cos(crop, mean of the templates'
    unit text embeddings), crops with the mask outside painted grey."""
    from fgrpo.rewards.clip import image_embeddings, load_clip, text_embeddings
    from fgrpo.rewards.geneval import COLOR_TEMPLATES, COLORS, ColourClassifier

    clip = load_clip(str(clip_folder), None, "float32", "cpu")
    classifier = ColourClassifier(clip)
    image = scenes(32)[0]
    mask = torch.zeros(32, 32, dtype=torch.bool)
    mask[4:20, 6:30] = True
    dets = [Detection("car", 0.9, (6.0, 4.0, 30.0, 20.0), mask), Detection("car", 0.8, (0.0, 0.0, 31.0, 31.0))]
    got = classifier(image, dets, "car")
    grey = torch.where(mask, image, torch.full_like(image, 153 / 255))
    crops = [grey[:, 4:20, 6:30], image[:, 0:31, 0:31]]
    texts = text_embeddings(clip, [t.format(c=c, cls="car") for c in COLORS for t in COLOR_TEMPLATES], 64)
    proto = torch.nn.functional.normalize(texts.view(10, 3, -1).mean(1), dim=-1)
    expected = [COLORS[int((image_embeddings(clip, c[None], 1) @ proto.T).argmax())] for c in crops]
    assert got == expected


def test_unsupported_detector_names_the_key(clip_folder, offline):
    with pytest.raises(registry.ComponentError, match=r"reward.detector: .* is a 'clip' model; supported"):
        registry.create("reward", "geneval", detector=str(clip_folder), clip=str(clip_folder), device="cpu")


def test_counting_edit_rows_are_scored_on_the_edited_images(tmp_path):
    """flow_grpo's dataset/counting_edit keeps GenEval's keys beside the instruction and its source
    image: the folder source hands them to geneval as metadata of each (instruction, image) prompt,
    and the counting rule scores the edited image (two rows share an instruction, not a source)."""
    import json

    from PIL import Image

    rows = [
        {
            "tag": "counting",
            "include": [{"class": "cat", "count": 2}],
            "exclude": [{"class": "cat", "count": 3}],
            "t2i_prompt": "a photo of one cat",
            "prompt": "Change the number of cat in the image to two.",
            "image": "a.png",
        },
        {
            "tag": "counting",
            "include": [{"class": "cat", "count": 2}],
            "exclude": [{"class": "cat", "count": 3}],
            "t2i_prompt": "a photo of three cats",
            "prompt": "Change the number of cat in the image to two.",
            "image": "b.png",
        },
    ]
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    (tmp_path / "train_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = registry.create("prompts", "folder", path=str(tmp_path), test=None)
    prompts = source.train_prompts()
    assert prompts[0] != prompts[1]
    stub = StubDetector(
        {0: [det("cat"), det("cat", RIGHT)], 1: [det("cat"), det("cat", RIGHT), det("cat", (40, 40, 60, 60))]}
    )
    verifier = Verifier(stub, lambda image, dets, cls: ["red"] * len(dets), threshold=0.3, counting_threshold=0.9)
    images = torch.zeros(2, 3, 8, 8)
    images[1] += 0.1  # the stub's scene 1: three cats
    two, three = verifier.verdicts(images, [source.metadata(p) for p in prompts])
    assert two.strict and not three.strict  # the edit to two cats done, and not done

"""``geneval``: a GenEval-style compositional verifier for real images.

It reads GenEval's prompt metadata (``{"tag", "include": [{"class", "count", "color"?,
"position"?: [relation, index]}], "exclude": [{"class", "count"}]}``, as the ``folder`` prompt
source passes it), detects objects with a transformers detector, classifies the colour of each
detected object with CLIP on its crop, and judges counts, colours and relative positions from the
boxes, with GenEval's thresholds and rules (Ghosh et al. 2023, ``evaluation/evaluate_images.py``).

Three verdicts per image, all in the details:

- ``geneval``: GenEval's benchmark rule: at least ``count`` objects of each included class (the
  ``count`` most confident are checked for colour and position), fewer than ``count`` of each
  excluded class.
- ``strict``: flow_grpo's strict accuracy: exactly ``count`` objects of each included class, all
  of the asked colour and position (exclusions are implied by exact counts).
- ``partial``: flow_grpo's partial score (its GenEval training reward): the mean over the
  requirements of 1 - |count - found| / count for each included class (negative when more than
  twice the asked count are found), the same for the colour matches, and 1/0 for a position.
  One deviation: flow_grpo appends both a 0 and a 1 for a failed position; here it is 0.

Needs the ``[clip]`` extra (transformers). The detector is ``detector: <hub id or folder>``:
Mask2Former (GenEval's own detector family: ``facebook/mask2former-swin-small-coco-instance``, 80
COCO classes named as GenEval names them), or an open-vocabulary OWLv2 / OWL-ViT (queried with
the class names the prompt's metadata mentions, so unseen classes work too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.visuals import to_uint8
from fgrpo.rewards.clip import (
    CLIP,
    DTYPES,
    check_images,
    device_key,
    dtype_key,
    load_clip,
    loading_error,
    preprocess,
    require_transformers,
    resolve_device,
    shared,
    text_embeddings,
)

#: GenEval's names of the 80 COCO classes, in COCO's order (evaluation/object_names.txt)
COCO_CLASSES = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
CROP_BACKGROUND = 153 / 255  # GenEval pastes the object's mask on grey #999 before cropping
RELATIONS = ("left of", "right of", "above", "below")


@attrs.frozen
class Detection:
    """One detected object: its class name, confidence, box (x0, y0, x1, y1) in pixels and an
    optional (H, W) boolean mask."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: torch.Tensor | None = None


class Detector(Protocol):
    """Detects objects in a batch of images (B, 3, H, W) in [0, 1]; ``classes[b]`` are the class
    names image b's metadata mentions (an open-vocabulary detector queries them; a closed-set
    one may return any of its classes)."""

    def __call__(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[list[Detection]]: ...


# --- GenEval's rules ---------------------------------------------------------------------------


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU with GenEval's inclusive-pixel convention (+1 on each side)."""

    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select_objects(
    detections: Sequence[Detection], threshold: float, max_objects: int, nms_threshold: float
) -> dict[str, list[Detection]]:
    """Per class: detections above ``threshold``, most confident first, at most ``max_objects``,
    then greedy suppression of boxes overlapping a kept one by ``nms_threshold`` or more (1 = off)."""
    by_class: dict[str, list[Detection]] = {}
    for det in sorted(detections, key=lambda d: -d.score):
        if det.score > threshold:
            by_class.setdefault(det.label, []).append(det)
    kept: dict[str, list[Detection]] = {}
    for label, dets in by_class.items():
        queue, out = dets[:max_objects], []
        while queue:
            best = queue.pop(0)
            out.append(best)
            if nms_threshold < 1:
                queue = [d for d in queue if box_iou(best.box, d.box) < nms_threshold]
        kept[label] = out
    return kept


def relative_position(a: Sequence[float], b: Sequence[float], threshold: float = 0.1) -> set[str]:
    """Where box a lies relative to box b: GenEval's rule. The centre offset is shrunk by
    ``threshold`` x (the two boxes' summed sizes) per axis; a relation holds when the shrunk offset
    makes up more than half of the full offset's length along that axis."""
    boxes = np.array([a[:4], b[:4]], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - threshold * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


@attrs.frozen
class Verdict:
    geneval: bool
    strict: bool
    partial: float
    reason: str


def _positions_hold(
    objects: Sequence[Detection], targets: Sequence[Detection], relation: str, threshold: float
) -> bool:
    return all(relation in relative_position(o.box, t.box, threshold) for o in objects for t in targets)


def judge(
    objects: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    colours_of: Callable[[str], list[str]],
    position_threshold: float = 0.1,
) -> Verdict:
    """The three verdicts for one image. ``objects`` is what :func:`select_objects` kept;
    ``colours_of(class)`` the CLIP colour of each of those objects, in the same order."""
    correct, reasons = geneval_rule(objects, metadata, colours_of, position_threshold)
    strict, partial = flow_grpo_scores(objects, metadata, colours_of, position_threshold)
    return Verdict(geneval=correct, strict=strict, partial=partial, reason="; ".join(reasons))


def geneval_rule(
    objects: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    colours_of: Callable[[str], list[str]],
    threshold: float,
) -> tuple[bool, list[str]]:
    """GenEval's verdict: at least ``count`` objects of each included class (the first ``count`` of
    them with the colour and the position asked for), fewer than ``count`` of each excluded one;
    and why not."""
    reasons: list[str] = []
    correct = True
    groups: list[Any] = []  # per requirement: the objects found, or None
    for req in metadata.get("include", []):
        cls, count = req["class"], int(req["count"])
        found = list(objects.get(cls, []))[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {cls}>={count}, found {len(found)}")
        elif "color" in req:
            matches = colours_of(cls)[:count].count(req["color"])
            if matches < count:
                ok = False
                reasons.append(f"expected {req['color']} {cls}>={count}, found {matches} {req['color']}")
        if ok and "position" in req:
            relation, target = req["position"]
            if groups[target] is None:
                ok = False
                reasons.append(f"no target for {cls} to be {relation}")
            elif not _positions_hold(found, groups[target], relation, threshold):
                ok = False
                reasons.append(f"expected {cls} {relation} target")
        correct &= ok
        groups.append(found if ok else None)
    for req in metadata.get("exclude", []):
        n = len(objects.get(req["class"], []))
        if n >= int(req["count"]):
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
    return correct, reasons


def flow_grpo_scores(
    objects: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    colours_of: Callable[[str], list[str]],
    threshold: float,
) -> tuple[bool, float]:
    """flow_grpo's strict verdict (exactly ``count`` objects of each included class, all of them
    with the colour and position asked for) and its partial score (the mean of the count, colour
    and position parts)."""
    strict, parts = True, []
    groups: list[Any] = []  # per requirement: the objects found, or None
    for req in metadata.get("include", []):
        cls, count = req["class"], int(req["count"])
        found = list(objects.get(cls, []))
        parts.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            if "color" in req or "position" in req:
                parts.append(0.0)
        else:
            if "color" in req:
                matches = colours_of(cls).count(req["color"])
                parts.append(1 - abs(count - matches) / count)
                ok = matches == count
            if ok and "position" in req:
                relation, target = req["position"]
                ok = groups[target] is not None and _positions_hold(found, groups[target], relation, threshold)
                parts.append(1.0 if ok else 0.0)
        strict &= ok
        groups.append(found if ok else None)
    return strict, sum(parts) / len(parts) if parts else 0.0


def mentioned_classes(metadata: Mapping[str, Any]) -> list[str]:
    names = [r["class"] for r in metadata.get("include", [])] + [r["class"] for r in metadata.get("exclude", [])]
    return list(dict.fromkeys(names))


def check_metadata(metadata: Any, index: int) -> None:
    """A clear error for rows that are not GenEval metadata (a text prompt source, a typo)."""
    where = f"geneval: metadata of sample {index}"
    if not isinstance(metadata, Mapping) or "tag" not in metadata or not isinstance(metadata.get("include"), list):
        raise ValueError(
            f"{where} has no GenEval 'tag' and 'include' (got {metadata!r}); use a prompt source with GenEval "
            f"metadata, e.g. prompts: {{name: folder, path: <geneval dataset>}}"
        )
    for req in metadata["include"] + list(metadata.get("exclude", [])):
        if (
            not isinstance(req, Mapping)
            or not isinstance(req.get("class"), str)
            or not isinstance(req.get("count"), int)
            or req["count"] < 1
        ):
            raise ValueError(
                f"{where}: every include/exclude entry needs a 'class' and a positive 'count', got {req!r}"
            )
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"{where}: colour {req['color']!r} is not one of {', '.join(COLORS)}")
        if "position" in req:
            relation, target = req["position"]
            if relation not in RELATIONS or not 0 <= int(target) < metadata["include"].index(req):
                raise ValueError(
                    f"{where}: position {req['position']!r} needs one of {', '.join(RELATIONS)} and an earlier "
                    f"include index"
                )


# --- colour by CLIP on the crop ----------------------------------------------------------------


def object_crop(image: torch.Tensor, det: Detection) -> torch.Tensor:
    """(3, h, w): the object's box cut from the image, outside its mask replaced by grey."""
    if det.mask is not None:
        mask = det.mask.to(image.device, torch.bool)
        image = torch.where(mask, image, torch.full_like(image, CROP_BACKGROUND))
    h, w = image.shape[-2:]
    x0, y0, x1, y1 = (int(round(v)) for v in det.box)
    x0, y0 = min(max(x0, 0), w - 1), min(max(y0, 0), h - 1)
    x1, y1 = max(min(x1, w), x0 + 1), max(min(y1, h), y0 + 1)
    return image[:, y0:y1, x0:x1]


@attrs.define
class ColourClassifier:
    """CLIP zero-shot over GenEval's ten colours with its three templates (the text classifier of
    a class is the normalised mean of its templates' unit embeddings; crops are compared by cosine)."""

    clip: CLIP
    _classifiers: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)

    def classifier(self, cls: str) -> torch.Tensor:
        if cls not in self._classifiers:
            texts = [t.format(c=c, cls=cls) for c in COLORS for t in COLOR_TEMPLATES]
            emb = text_embeddings(self.clip, texts, len(texts)).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            self._classifiers[cls] = F.normalize(emb.mean(dim=1), dim=-1)
        return self._classifiers[cls]

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, detections: Sequence[Detection], cls: str) -> list[str]:
        if not detections:
            return []
        crops = [
            preprocess(object_crop(image, d)[None].to(self.clip.device), self.clip.image_config) for d in detections
        ]
        pixels = torch.cat(crops).to(self.clip.dtype)
        out = self.clip.model.get_image_features(pixel_values=pixels)
        feats = F.normalize((out if isinstance(out, torch.Tensor) else out.pooler_output).float(), dim=-1)
        return [COLORS[i] for i in (feats @ self.classifier(cls).T).argmax(dim=1).tolist()]


# --- detectors from transformers ---------------------------------------------------------------


@attrs.define
class Mask2FormerDetector:
    """Closed-set instance segmentation (GenEval's detector family); boxes from the masks."""

    model: Any
    processor: Any
    class_names: tuple[str, ...]
    threshold: float

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[list[Detection]]:
        device = next(self.model.parameters()).device
        inputs = self.processor(images=list(to_uint8(images)), return_tensors="pt").to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(next(self.model.parameters()).dtype)
        outputs = self.model(**inputs)
        sizes = [tuple(images.shape[-2:])] * images.shape[0]
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=self.threshold, target_sizes=sizes, return_binary_maps=True
        )
        batch = []
        for result in results:
            dets = []
            for k, info in enumerate(result["segments_info"]):
                mask = result["segmentation"][k].bool()  # binary maps: one (H, W) map per segment
                if not mask.any():
                    continue
                ys, xs = torch.nonzero(mask, as_tuple=True)
                box = (float(xs.min()), float(ys.min()), float(xs.max()), float(ys.max()))
                dets.append(Detection(self.class_names[int(info["label_id"])], float(info["score"]), box, mask.cpu()))
            batch.append(dets)
        return batch


@attrs.define
class OwlDetector:
    """Open-vocabulary detection (OWLv2 / OWL-ViT) queried with "a photo of a <class>". Every
    predicted box is a detection of every queried class whose sigmoid score passes the threshold
    (as a closed-set detector scores each box per class), so an image's detections do not depend
    on the other images' queries. Boxes only: colour crops keep their background."""

    model: Any
    processor: Any
    threshold: float
    padded_square: bool  # OWLv2 pads images to a square: its boxes are relative to that square

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[list[Detection]]:
        device = next(self.model.parameters()).device
        names = sorted({c for cs in classes for c in cs})
        if not names:
            return [[] for _ in range(images.shape[0])]
        queries = [[f"a photo of a {c}" for c in names]] * images.shape[0]
        inputs = self.processor(text=queries, images=list(to_uint8(images)), return_tensors="pt").to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(next(self.model.parameters()).dtype)
        outputs = self.model(**inputs)
        probs = outputs.logits.float().sigmoid().cpu()  # (B, boxes, queries)
        cx, cy, bw, bh = outputs.pred_boxes.float().cpu().unbind(-1)  # centre/size, relative
        h, w = images.shape[-2:]
        sx, sy = (max(h, w), max(h, w)) if self.padded_square else (w, h)
        corners = torch.stack([(cx - bw / 2) * sx, (cy - bh / 2) * sy, (cx + bw / 2) * sx, (cy + bh / 2) * sy], -1)
        corners[..., 0::2] = corners[..., 0::2].clamp(0, w - 1)
        corners[..., 1::2] = corners[..., 1::2].clamp(0, h - 1)
        batch = []
        for b, wanted in enumerate(classes):
            dets = []
            for cls in wanted:
                q = names.index(cls)
                for k in torch.nonzero(probs[b, :, q] > self.threshold).flatten().tolist():
                    dets.append(Detection(cls, float(probs[b, k, q]), tuple(corners[b, k].tolist())))
            batch.append(dets)
        return batch


def load_detector(
    path: str, threshold: float, dtype: str, device: str | None, key: str = "reward.detector"
) -> Detector:
    """A detector from a hub id or folder, chosen by its config's model type; once per process."""
    require_transformers()
    dev = resolve_device(device)

    def build() -> Detector:
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor

        from fgrpo.core.hub import pretrained_source  # absent weights: one message at once

        source = pretrained_source(path, key=key)
        where, kw = source.location, source.kwargs
        try:
            config = AutoConfig.from_pretrained(where, **kw)
        except OSError as exc:
            raise loading_error(key, path, "a detector", exc) from exc
        kind = config.model_type
        try:
            if kind in ("mask2former", "maskformer"):
                from transformers import AutoModelForUniversalSegmentation

                model = AutoModelForUniversalSegmentation.from_pretrained(where, **kw)
                processor = AutoImageProcessor.from_pretrained(where, **kw)
                labels = [config.id2label[i] for i in range(len(config.id2label))]
                names = COCO_CLASSES if len(labels) == len(COCO_CLASSES) else tuple(labels)
                made: Any = Mask2FormerDetector(model, processor, names, threshold)
            elif kind in ("owlv2", "owlvit"):
                from transformers import AutoModelForZeroShotObjectDetection

                model = AutoModelForZeroShotObjectDetection.from_pretrained(where, **kw)
                processor = AutoProcessor.from_pretrained(where, **kw)
                made = OwlDetector(model, processor, threshold, padded_square=kind == "owlv2")
            else:
                raise ValueError(
                    f"{key}: {path!r} is a {kind!r} model; supported: mask2former, maskformer, owlv2, owlvit"
                )
        except OSError as exc:
            raise loading_error(key, path, f"a {kind} detector and its processor", exc) from exc
        made.model = made.model.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False)
        return made

    return shared(("detector", path, threshold, dtype, str(dev)), build)


# --- the reward --------------------------------------------------------------------------------


@attrs.define
class Verifier:
    """Detector + colour classifier + GenEval's rules, on a batch."""

    detector: Detector
    colours: Callable[[torch.Tensor, Sequence[Detection], str], list[str]]
    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    nms_threshold: float = 1.0
    position_threshold: float = 0.1

    def verdicts(self, images: torch.Tensor, metadata: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        for i, meta in enumerate(metadata):
            check_metadata(meta, i)
        detections = self.detector(images, [mentioned_classes(m) for m in metadata])
        out = []
        for image, dets, meta in zip(images, detections, metadata, strict=True):
            limit = self.counting_threshold if meta["tag"] == "counting" else self.threshold
            objects = select_objects(dets, limit, self.max_objects, self.nms_threshold)
            memo: dict[str, list[str]] = {}

            def colours_of(cls: str, image=image, objects=objects, memo=memo) -> list[str]:
                if cls not in memo:
                    memo[cls] = self.colours(image, objects.get(cls, []), cls)
                return memo[cls]

            out.append(judge(objects, meta, colours_of, self.position_threshold))
        return out


@attrs.define
class GenEval:
    """GenEval-style verifier: scores ``partial`` (flow_grpo's training reward, default),
    ``strict`` or ``geneval`` (the benchmark's rule); all three, the GenEval ``category`` (the
    metadata's tag) and a ``reason`` per image are in the details, so evaluation reports each per
    category (``eval/geneval/strict/counting`` ...). Confidence thresholds as GenEval's: 0.3,
    0.9 for counting prompts (tuned for Mask2Former; an OWLv2 detector wants lower ones, about
    0.1-0.3).
    """

    detector: str = param(
        "facebook/mask2former-swin-small-coco-instance",
        help="hub id or folder of a Mask2Former, OWLv2 or OWL-ViT detector",
    )
    clip: str = param("openai/clip-vit-large-patch14", help="hub id or folder of the CLIP that names colours")
    score: str = param("partial", choices=("partial", "strict", "geneval"), help="which verdict is the score")
    threshold: float = param(0.3, ge=0, le=1, help="detection confidence kept (GenEval: 0.3)")
    counting_threshold: float = param(
        0.9, ge=0, le=1, help="detection confidence kept for counting prompts (GenEval: 0.9)"
    )
    max_objects: int = param(16, ge=1, help="most confident detections kept per class")
    nms_threshold: float = param(
        1.0, gt=0, le=1, help="drop a box overlapping a kept one of its class by this IoU; 1 = off (GenEval)"
    )
    position_threshold: float = param(
        0.1, ge=0, help="GenEval's relative-position margin, a fraction of the boxes' sizes"
    )
    batch_size: int = param(16, ge=1, help="images per detector forward pass")
    dtype: str = dtype_key("the detector and CLIP weights")
    device: str | None = device_key()
    _verifier: Verifier = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        lowest = min(self.threshold, self.counting_threshold)
        detector = load_detector(self.detector, lowest, self.dtype, self.device)
        colours = shared(
            ("colours", self.clip, self.dtype, str(resolve_device(self.device))),
            lambda: ColourClassifier(load_clip(self.clip, None, self.dtype, self.device, key="reward.clip")),
        )
        self._verifier = Verifier(
            detector,
            colours,
            self.threshold,
            self.counting_threshold,
            self.max_objects,
            self.nms_threshold,
            self.position_threshold,
        )

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        check_images(outputs, prompts, "geneval")
        verdicts = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = outputs[start : start + self.batch_size]
            verdicts += self._verifier.verdicts(chunk, list(metadata[start : start + self.batch_size]))
        return verdict_result(verdicts, [m["tag"] for m in metadata], self.score)


def verdict_result(verdicts: Sequence[Verdict], tags: Sequence[str], score: str) -> RewardResult:
    details: dict[str, Any] = {
        "geneval": torch.tensor([float(v.geneval) for v in verdicts]),
        "strict": torch.tensor([float(v.strict) for v in verdicts]),
        "partial": torch.tensor([v.partial for v in verdicts], dtype=torch.float32),
        "category": list(tags),
        "reason": [v.reason for v in verdicts],
    }
    return RewardResult(scores=details[score].clone(), details=details)

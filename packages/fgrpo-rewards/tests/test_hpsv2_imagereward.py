"""hpsv2 and imagereward: published-layout checkpoints (open_clip / BLIP key names) of tiny random
models, loaded through the same code as the real files, scored against reference forward passes
written here from the upstream architectures (open_clip's CLIP; BLIP's ViT and BERT with
cross-attention) and the upstream score formulas."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance

transformers = pytest.importorskip("transformers")

PROMPTS = ["a red square", "a blue circle", "a green triangle", "the word GRPO"]


def images(n=4, size=32):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, size, size), generator=gen).float() / 255


def normalised(x):  # OpenAI's mean/std: the only preprocessing at the model's own resolution
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    return (x - mean) / std


def randn(*shape, scale=0.2):
    return torch.randn(*shape) * scale


# --- hpsv2: an open_clip ViT CLIP --------------------------------------------------------------

WIDTH, EMBED, LAYERS, HEADS, PATCH, SIZE, CONTEXT, FF = 32, 16, 2, 4, 8, 32, 77, 37  # as save_tiny_clip


def open_clip_state(vocab: int) -> dict[str, torch.Tensor]:
    """A random state dict with open_clip's CLIP key names and shapes."""
    torch.manual_seed(3)
    state = {
        "visual.conv1.weight": randn(WIDTH, 3, PATCH, PATCH),
        "visual.class_embedding": randn(WIDTH),
        "visual.positional_embedding": randn((SIZE // PATCH) ** 2 + 1, WIDTH),
        "visual.proj": randn(WIDTH, EMBED),
        "token_embedding.weight": randn(vocab, WIDTH),
        "positional_embedding": randn(CONTEXT, WIDTH),
        "text_projection": randn(WIDTH, EMBED),
        "logit_scale": torch.tensor(math.log(100.0)),
        "attn_mask": torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1),
    }
    for name in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        state[f"{name}.weight"], state[f"{name}.bias"] = 1 + randn(WIDTH), randn(WIDTH)
    for tower in ("visual.transformer", "transformer"):
        for i in range(LAYERS):
            p = f"{tower}.resblocks.{i}."
            for ln in ("ln_1", "ln_2"):
                state[p + ln + ".weight"], state[p + ln + ".bias"] = 1 + randn(WIDTH), randn(WIDTH)
            state[p + "attn.in_proj_weight"], state[p + "attn.in_proj_bias"] = (
                randn(3 * WIDTH, WIDTH),
                randn(3 * WIDTH),
            )
            state[p + "attn.out_proj.weight"], state[p + "attn.out_proj.bias"] = randn(WIDTH, WIDTH), randn(WIDTH)
            state[p + "mlp.c_fc.weight"], state[p + "mlp.c_fc.bias"] = randn(FF, WIDTH), randn(FF)
            state[p + "mlp.c_proj.weight"], state[p + "mlp.c_proj.bias"] = randn(WIDTH, FF), randn(WIDTH)
    return state


def open_clip_blocks(x, state, tower, mask=None):
    """open_clip's residual attention blocks: x + attn(ln_1(x)); x + mlp(ln_2(x)), GELU."""
    for i in range(LAYERS):
        p = f"{tower}.resblocks.{i}."
        h = F.layer_norm(x, (WIDTH,), state[p + "ln_1.weight"], state[p + "ln_1.bias"])
        attn, _ = F.multi_head_attention_forward(
            h.transpose(0, 1),
            h.transpose(0, 1),
            h.transpose(0, 1),
            WIDTH,
            HEADS,
            state[p + "attn.in_proj_weight"],
            state[p + "attn.in_proj_bias"],
            None,
            None,
            False,
            0.0,
            state[p + "attn.out_proj.weight"],
            state[p + "attn.out_proj.bias"],
            need_weights=False,
            attn_mask=mask,
        )
        x = x + attn.transpose(0, 1)
        h = F.layer_norm(x, (WIDTH,), state[p + "ln_2.weight"], state[p + "ln_2.bias"])
        h = F.linear(
            F.gelu(F.linear(h, state[p + "mlp.c_fc.weight"], state[p + "mlp.c_fc.bias"])),
            state[p + "mlp.c_proj.weight"],
            state[p + "mlp.c_proj.bias"],
        )
        x = x + h
    return x


def open_clip_encode_image(state, pixels):
    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = (
        torch.cat([state["visual.class_embedding"].expand(x.shape[0], 1, WIDTH), x], dim=1)
        + state["visual.positional_embedding"]
    )
    x = F.layer_norm(x, (WIDTH,), state["visual.ln_pre.weight"], state["visual.ln_pre.bias"])
    x = open_clip_blocks(x, state, "visual.transformer")
    return (
        F.layer_norm(x[:, 0], (WIDTH,), state["visual.ln_post.weight"], state["visual.ln_post.bias"])
        @ state["visual.proj"]
    )


def open_clip_encode_text(state, ids):
    """ids padded with 0 to the context length, pooled at the end-of-text token (the largest id)."""
    x = state["token_embedding.weight"][ids] + state["positional_embedding"]
    x = open_clip_blocks(x, state, "transformer", mask=state["attn_mask"])
    x = F.layer_norm(x, (WIDTH,), state["ln_final.weight"], state["ln_final.bias"])
    return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ state["text_projection"]


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    """A CLIP config/tokenizer/processor folder (GELU, as ViT-H-14) and an HPS-style checkpoint."""
    from fgrpo.rewards.testing import clip_tokenizer, save_tiny_clip

    folder = save_tiny_clip(tmp_path_factory.mktemp("hps-clip"), hidden_act="gelu")
    state = open_clip_state(len(clip_tokenizer().get_vocab()))
    checkpoint = folder / "HPS_v2_compressed.pt"
    torch.save({"state_dict": state}, checkpoint)
    return folder, checkpoint, state


@pytest.fixture
def hps(hps_files, offline):
    folder, checkpoint, _ = hps_files
    return registry.create("reward", "hpsv2", checkpoint=str(checkpoint), path=str(folder), device="cpu", batch_size=3)


class TestHPSv2(RewardConformance):
    reward_name = "hpsv2"

    @pytest.fixture
    def reward(self, hps):
        return hps

    def make_inputs(self):
        return images(), list(PROMPTS), [{} for _ in PROMPTS]


def test_hpsv2_is_hpsv2s_formula_on_open_clips_forward(hps, hps_files):
    """HPSv2: diag(unit image features @ unit text features.T), with open_clip's tokenisation
    (start, tokens, end, zeros to 77) and its forward pass, against the mapped CLIPModel."""
    from fgrpo.rewards.testing import clip_tokenizer

    _, _, state = hps_files
    tokenizer = clip_tokenizer()
    ids = torch.zeros(len(PROMPTS), CONTEXT, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS):
        tokens = tokenizer(prompt)["input_ids"]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    with torch.no_grad():
        image = F.normalize(open_clip_encode_image(state, normalised(images())), dim=-1)
        text = F.normalize(open_clip_encode_text(state, ids), dim=-1)
    expected = (image @ text.T).diagonal()
    torch.testing.assert_close(hps(images(), PROMPTS, [{}] * 4).scores, expected, atol=1e-5, rtol=1e-5)
    alone = torch.cat([hps(images()[i : i + 1], PROMPTS[i : i + 1], [{}]).scores for i in range(4)])
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-5)


def test_hpsv2_checkpoint_errors_name_the_key(hps_files, tmp_path, offline):
    folder, _, state = hps_files
    bad = tmp_path / "other.pt"
    torch.save({"state_dict": {**state, "visual.head.weight": torch.zeros(2)}}, bad)
    with pytest.raises(registry.ComponentError, match=r"reward.checkpoint: .*unknown keys: visual.head.weight"):
        registry.create("reward", "hpsv2", checkpoint=str(bad), path=str(folder), device="cpu")
    short = tmp_path / "short.pt"
    torch.save({k: v for k, v in state.items() if not k.startswith("ln_final")}, short)
    with pytest.raises(registry.ComponentError, match=r"reward.checkpoint: .*missing"):
        registry.create("reward", "hpsv2", checkpoint=str(short), path=str(folder), device="cpu")


# --- imagereward: BLIP's ViT + BERT with cross-attention + ImageReward's head --------------------

V_WIDTH, V_LAYERS, V_HEADS = 64, 2, 1  # BLIP's heads are 64 wide
T_WIDTH, T_LAYERS, T_HEADS, T_FF = 32, 2, 4, 48
WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *"abcdefghijklmnopqrstuvwxyz",
    "red",
    "blue",
    "green",
    "square",
    "circle",
    "triangle",
    "the",
    "word",
    "grp",
    "##o",
    "a",
]
MED = {
    "vocab_size": len(WORDS) + 2,
    "hidden_size": T_WIDTH,
    "num_hidden_layers": T_LAYERS,
    "num_attention_heads": T_HEADS,
    "intermediate_size": T_FF,
    "max_position_embeddings": 40,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "add_cross_attention": True,
    "encoder_width": 768,
    "pad_token_id": 0,
}


def blip_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(4)
    state = {
        "blip.visual_encoder.cls_token": randn(1, 1, V_WIDTH),
        "blip.visual_encoder.pos_embed": randn(1, 17, V_WIDTH),
        "blip.visual_encoder.patch_embed.proj.weight": randn(V_WIDTH, 3, 8, 8),
        "blip.visual_encoder.patch_embed.proj.bias": randn(V_WIDTH),
        "blip.visual_encoder.norm.weight": 1 + randn(V_WIDTH),
        "blip.visual_encoder.norm.bias": randn(V_WIDTH),
        "blip.text_encoder.embeddings.word_embeddings.weight": randn(MED["vocab_size"], T_WIDTH),
        "blip.text_encoder.embeddings.position_embeddings.weight": randn(40, T_WIDTH),
        "blip.text_encoder.embeddings.LayerNorm.weight": 1 + randn(T_WIDTH),
        "blip.text_encoder.embeddings.LayerNorm.bias": randn(T_WIDTH),
        "blip.vision_proj.weight": randn(16, V_WIDTH),
        "blip.vision_proj.bias": randn(16),  # unused by ImageReward
        "blip.text_encoder.embeddings.position_ids": torch.arange(40)[None],  # a buffer the real file holds
    }
    for i in range(V_LAYERS):
        p = f"blip.visual_encoder.blocks.{i}."
        for name, shape in (
            ("norm1", None),
            ("norm2", None),
            ("attn.qkv", (3 * V_WIDTH, V_WIDTH)),
            ("attn.proj", (V_WIDTH, V_WIDTH)),
            ("mlp.fc1", (4 * V_WIDTH, V_WIDTH)),
            ("mlp.fc2", (V_WIDTH, 4 * V_WIDTH)),
        ):
            out = shape[0] if shape else V_WIDTH
            state[p + name + ".weight"] = 1 + randn(V_WIDTH) if shape is None else randn(*shape)
            state[p + name + ".bias"] = randn(out)
    for i in range(T_LAYERS):
        p = f"blip.text_encoder.encoder.layer.{i}."
        for block, source in (("attention", T_WIDTH), ("crossattention", V_WIDTH)):
            for proj, width in (("query", T_WIDTH), ("key", source), ("value", source)):
                state[f"{p}{block}.self.{proj}.weight"], state[f"{p}{block}.self.{proj}.bias"] = (
                    randn(T_WIDTH, width),
                    randn(T_WIDTH),
                )
            state[f"{p}{block}.output.dense.weight"], state[f"{p}{block}.output.dense.bias"] = (
                randn(T_WIDTH, T_WIDTH),
                randn(T_WIDTH),
            )
            state[f"{p}{block}.output.LayerNorm.weight"], state[f"{p}{block}.output.LayerNorm.bias"] = (
                1 + randn(T_WIDTH),
                randn(T_WIDTH),
            )
        state[p + "intermediate.dense.weight"], state[p + "intermediate.dense.bias"] = (
            randn(T_FF, T_WIDTH),
            randn(T_FF),
        )
        state[p + "output.dense.weight"], state[p + "output.dense.bias"] = randn(T_WIDTH, T_FF), randn(T_WIDTH)
        state[p + "output.LayerNorm.weight"], state[p + "output.LayerNorm.bias"] = 1 + randn(T_WIDTH), randn(T_WIDTH)
    for i, (n_in, n_out) in zip(
        (0, 2, 4, 6, 7), ((T_WIDTH, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)), strict=True
    ):
        state[f"mlp.layers.{i}.weight"], state[f"mlp.layers.{i}.bias"] = (
            randn(n_out, n_in, scale=n_in**-0.5),
            randn(n_out),
        )
    return state


def attention(q_in, kv_in, s, p, heads, mask=None):
    """Multi-head attention with separate q/k/v Linear weights under prefix p."""
    b, n, _ = q_in.shape
    q = F.linear(q_in, s[p + "query.weight"], s[p + "query.bias"]).view(b, n, heads, -1).transpose(1, 2)
    k = F.linear(kv_in, s[p + "key.weight"], s[p + "key.bias"]).view(b, kv_in.shape[1], heads, -1).transpose(1, 2)
    v = F.linear(kv_in, s[p + "value.weight"], s[p + "value.bias"]).view(b, kv_in.shape[1], heads, -1).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + (1 - mask[:, None, None, :].float()) * -10000.0  # BERT's extended mask
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


def blip_vit(s, pixels):
    """BLIP's ViT (timm's VisionTransformer): pre-norm blocks, eps 1e-6, the final norm on all tokens."""
    p = "blip.visual_encoder."
    x = (
        F.conv2d(pixels, s[p + "patch_embed.proj.weight"], s[p + "patch_embed.proj.bias"], stride=8)
        .flatten(2)
        .transpose(1, 2)
    )
    x = torch.cat([s[p + "cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + s[p + "pos_embed"]
    for i in range(V_LAYERS):
        q = f"{p}blocks.{i}."
        h = F.layer_norm(x, (V_WIDTH,), s[q + "norm1.weight"], s[q + "norm1.bias"], eps=1e-6)
        b, n, _ = h.shape
        qkv = (
            F.linear(h, s[q + "attn.qkv.weight"], s[q + "attn.qkv.bias"])
            .reshape(b, n, 3, V_HEADS, -1)
            .permute(2, 0, 3, 1, 4)
        )
        a = ((qkv[0] @ qkv[1].transpose(-2, -1)) * qkv[0].shape[-1] ** -0.5).softmax(-1) @ qkv[2]
        x = x + F.linear(a.transpose(1, 2).reshape(b, n, -1), s[q + "attn.proj.weight"], s[q + "attn.proj.bias"])
        h = F.layer_norm(x, (V_WIDTH,), s[q + "norm2.weight"], s[q + "norm2.bias"], eps=1e-6)
        x = x + F.linear(
            F.gelu(F.linear(h, s[q + "mlp.fc1.weight"], s[q + "mlp.fc1.bias"])),
            s[q + "mlp.fc2.weight"],
            s[q + "mlp.fc2.bias"],
        )
    return F.layer_norm(x, (V_WIDTH,), s[p + "norm.weight"], s[p + "norm.bias"], eps=1e-6)


def blip_bert(s, ids, mask, image):
    """BLIP's med BERT in multimodal mode: post-norm layers, self-attention, cross-attention to
    every image token, feed-forward; the [CLS] output."""
    p = "blip.text_encoder."
    ln = lambda x, k: F.layer_norm(x, (T_WIDTH,), s[k + ".weight"], s[k + ".bias"], eps=1e-12)  # noqa: E731
    x = (
        s[p + "embeddings.word_embeddings.weight"][ids]
        + s[p + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    )
    x = ln(x, p + "embeddings.LayerNorm")
    for i in range(T_LAYERS):
        q = f"{p}encoder.layer.{i}."
        for block, source, m in (("attention", None, mask), ("crossattention", image, None)):
            a = attention(x, x if source is None else source, s, f"{q}{block}.self.", T_HEADS, m)
            x = ln(
                F.linear(a, s[f"{q}{block}.output.dense.weight"], s[f"{q}{block}.output.dense.bias"]) + x,
                f"{q}{block}.output.LayerNorm",
            )
        h = F.gelu(F.linear(x, s[q + "intermediate.dense.weight"], s[q + "intermediate.dense.bias"]))
        x = ln(F.linear(h, s[q + "output.dense.weight"], s[q + "output.dense.bias"]) + x, q + "output.LayerNorm")
    return x[:, 0]


@pytest.fixture(scope="module")
def ir_files(tmp_path_factory):
    from transformers import BertTokenizer

    folder = tmp_path_factory.mktemp("imagereward")
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder / "tokenizer")
    (folder / "med_config.json").write_text(json.dumps(MED))
    state = blip_state()
    torch.save(state, folder / "ImageReward.pt")
    return folder, state


@pytest.fixture
def image_reward(ir_files, offline):
    folder, _ = ir_files
    return registry.create(
        "reward",
        "imagereward",
        checkpoint=str(folder / "ImageReward.pt"),
        med_config=str(folder / "med_config.json"),
        tokenizer=str(folder / "tokenizer"),
        device="cpu",
        batch_size=3,
    )


class TestImageReward(RewardConformance):
    reward_name = "imagereward"

    @pytest.fixture
    def reward(self, image_reward):
        return image_reward

    def make_inputs(self):
        return images(), list(PROMPTS), [{} for _ in PROMPTS]


def test_imagereward_is_its_formula_on_blips_forward(image_reward, ir_files):
    """(MLP(BERT [CLS] with cross-attention to the ViT tokens) - mean) / std, tokens padded to 35."""
    from transformers import AutoTokenizer

    folder, state = ir_files
    tokens = AutoTokenizer.from_pretrained(folder / "tokenizer")(
        PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    with torch.no_grad():
        cls = blip_bert(state, tokens["input_ids"], tokens["attention_mask"], blip_vit(state, normalised(images())))
        x = cls
        for i in (0, 2, 4, 6, 7):
            x = F.linear(x, state[f"mlp.layers.{i}.weight"], state[f"mlp.layers.{i}.bias"])
    expected = (x.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072
    got = image_reward(images(), PROMPTS, [{}] * 4).scores
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got.std() > 0.05  # a head that tells the samples apart: the comparison means something
    alone = torch.cat([image_reward(images()[i : i + 1], PROMPTS[i : i + 1], [{}]).scores for i in range(4)])
    torch.testing.assert_close(alone, expected, atol=1e-4, rtol=1e-4)


def test_imagereward_wrong_files_name_the_key(ir_files, tmp_path, offline):
    folder, state = ir_files
    junk = tmp_path / "junk.pt"
    torch.save({"something": torch.zeros(1)}, junk)
    common = dict(med_config=str(folder / "med_config.json"), tokenizer=str(folder / "tokenizer"), device="cpu")
    with pytest.raises(registry.ComponentError, match=r"reward.checkpoint: .*not an ImageReward state dict"):
        registry.create("reward", "imagereward", checkpoint=str(junk), **common)
    other = tmp_path / "med.json"
    other.write_text(json.dumps({**MED, "intermediate_size": 64}))
    with pytest.raises(registry.ComponentError, match=r"reward.checkpoint: the text weights .* do not fit"):
        registry.create(
            "reward", "imagereward", checkpoint=str(folder / "ImageReward.pt"), **{**common, "med_config": str(other)}
        )

"""vlm-judge against a real OpenAI-compatible HTTP server on 127.0.0.1 started by the test: good
answers, yes/no with and without logprobs, malformed answers, slow answers, a flaky server, a
server that is down, a wrong key."""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance
from fgrpo.rewards.http import ServiceError
from fgrpo.rewards.vlm_judge import parse_number, parse_yes_no

KEY = "test-key"


class JudgeHandler(BaseHTTPRequestHandler):
    """Answers like a chat-completions server; what it says depends on the caption."""

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append((self.path, dict(self.headers), body))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self.reply(401, {"error": {"message": "invalid api key"}})
        content = body["messages"][0]["content"]
        if (
            "Image 1 is better" in content[-1]["text"]
        ):  # a comparison: the brighter image is better; "tie" answers neither
            first, second = (brightness(c["image_url"]["url"]) for c in content[:2])
            if "「tie」" in content[-1]["text"]:
                return self.answer("<think>equal</think><answer>They are equally good</answer>")
            return self.answer(f"<think>...</think><answer>Image {1 if first > second else 2} is better</answer>")
        caption = content[-1]["text"].rsplit("Caption: ", 1)[-1].rsplit("Instruction: ", 1)[-1]
        caption = caption.removeprefix("Does this image show: ").removesuffix("? Answer yes or no.")
        if caption.startswith("good"):
            return self.answer(f"Sharp and faithful. Final Score: {caption.split()[1]}")
        if caption == "likely yes":
            top = [
                {"token": "Yes", "logprob": math.log(0.6)},
                {"token": " yes", "logprob": math.log(0.2)},
                {"token": "No", "logprob": math.log(0.1)},
                {"token": "Maybe", "logprob": math.log(0.1)},
            ]
            return self.answer("Yes", {"content": [{"token": "Yes", "logprob": math.log(0.6), "top_logprobs": top}]})
        if caption == "plain no":
            return self.answer("No, it shows a cat.")
        if caption == "malformed":
            return self.answer("I cannot judge this image.")
        if caption == "garbage":
            return self.reply(200, None, raw=b"<html>proxy error</html>")
        if caption == "slow":
            time.sleep(1.5)
            return self.answer("Final Score: 5")
        if caption == "flaky":
            server.flaky += 1
            if server.flaky % 2:
                return self.reply(503, {"error": {"message": "overloaded"}})
            return self.answer("Final Score: 2")
        return self.reply(400, {"error": {"message": f"unknown caption {caption!r}"}})

    def answer(self, text, logprobs=None):
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        self.reply(200, {"id": "x", "object": "chat.completion", "choices": [choice]})

    def reply(self, status, data, raw=None):
        payload = raw if raw is not None else json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def brightness(url: str) -> float:
    picture = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    return float(torch.tensor(list(picture.getdata()), dtype=torch.float32).mean())


@pytest.fixture(scope="module")
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
    server.daemon_threads = True
    server.requests, server.flaky = [], 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def judge(judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    url = f"http://127.0.0.1:{judge_server.server_address[1]}/v1"

    def make(**params):
        base = {
            "model": "judge-7b",
            "url": url,
            "api_key_env": "JUDGE_KEY",
            "image_size": 16,
            "backoff": 0.01,
            "timeout": 5.0,
        }
        return registry.create("reward", "vlm-judge", **{**base, **params})

    return make


def images(n=4):
    return torch.rand(n, 3, 24, 24, generator=torch.Generator().manual_seed(0))


class TestVLMJudge(RewardConformance):
    reward_name = "vlm-judge"

    @pytest.fixture
    def reward(self, judge):
        return judge()

    def make_inputs(self):
        prompts = ["good 1", "good 2.5", "good 4", "good 5"]
        return images(), prompts, [{} for _ in prompts]


def test_scores_and_the_request(judge, judge_server):
    judge_server.requests.clear()
    result = judge()(images(), ["good 1", "good 2.5", "good 4", "good 5"], [{}] * 4)
    torch.testing.assert_close(result.scores, torch.tensor([0.2, 0.5, 0.8, 1.0]))
    assert result.details["fallback"].tolist() == [0.0] * 4
    assert result.details["answer"][0] == "Sharp and faithful. Final Score: 1"
    path, headers, body = judge_server.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == f"Bearer {KEY}"
    assert body["model"] == "judge-7b" and body["temperature"] == 0.0 and "logprobs" not in body
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (16, 16)


def test_yes_no_reads_logprobs_then_text(judge, judge_server):
    judge_server.requests.clear()
    result = judge(parse="yes-no")(images(2), ["likely yes", "plain no"], [{}, {}])
    torch.testing.assert_close(result.scores, torch.tensor([0.8 / 0.9, 0.0]))  # (0.6 + 0.2) / (0.6 + 0.2 + 0.1)
    assert all(body["logprobs"] is True and body["top_logprobs"] == 5 for _, _, body in judge_server.requests)


def test_malformed_answer_is_an_error_or_a_counted_fallback(judge, caplog):
    with pytest.raises(
        ServiceError, match=r"1 of 2 answers hold no score \(sample 1, prompt 'malformed'.*reward.fallback"
    ):
        judge()(images(2), ["good 3", "malformed"], [{}, {}])
    with pytest.raises(ServiceError, match="hold no score.*not a chat completion"):
        judge()(images(1), ["garbage"], [{}])
    reward = judge(fallback=0.0)
    with caplog.at_level("WARNING"):
        result = reward(images(3), ["good 3", "malformed", "garbage"], [{}] * 3)
    torch.testing.assert_close(result.scores, torch.tensor([0.6, 0.0, 0.0]))
    assert result.details["fallback"].tolist() == [0.0, 1.0, 1.0]
    assert "2 of 3 answers hold no score; scored 0" in caplog.text


def test_slow_answer_times_out_after_retries(judge):
    start = time.perf_counter()
    with pytest.raises(ServiceError, match=r"no answer within 0.3 s, after 1 retry"):
        judge(timeout=0.3, retries=1)(images(1), ["slow"], [{}])
    assert time.perf_counter() - start < 1.5  # two 0.3 s waits and a 0.01 s backoff, not the 1.5 s answer


def test_flaky_server_is_retried(judge, judge_server):
    judge_server.flaky = 0
    assert judge(retries=2)(images(1), ["flaky"], [{}]).scores.tolist() == [pytest.approx(0.4)]
    judge_server.flaky = 0
    with pytest.raises(ServiceError, match=r"HTTP 503 \(overloaded\), after 0 retries"):
        judge(retries=0)(images(1), ["flaky"], [{}])


def test_server_down(judge):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(
        ServiceError, match=rf"cannot reach http://127.0.0.1:{port}/v1/chat/completions .*after 2 retries"
    ):
        judge(url=f"http://127.0.0.1:{port}/v1", retries=2)(images(1), ["good 1"], [{}])


def test_wrong_key_is_not_retried(judge, judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    judge_server.requests.clear()
    with pytest.raises(ServiceError, match=r"refused the token \(HTTP 401: invalid api key\)"):
        judge(retries=3)(images(1), ["good 1"], [{}])
    assert len(judge_server.requests) == 1


def test_parsers():
    assert parse_number("Final Score: 4.5 because", r"Final Score:\s*([-+]?\d+(?:\.\d+)?)") == 4.5
    assert parse_number("score 7", r"\d+") == 7.0
    assert parse_yes_no("YES.", None) == 1.0 and parse_yes_no("no", {"content": []}) == 0.0
    with pytest.raises(ValueError):
        parse_yes_no("perhaps", None)


def test_bad_template_and_pattern_name_the_key():
    with pytest.raises(registry.ComponentError, match="reward.template"):
        registry.create("reward", "vlm-judge", model="m", template="{caption}")
    with pytest.raises(registry.ComponentError, match="reward.pattern"):
        registry.create("reward", "vlm-judge", model="m", pattern="(")


def test_pairwise_judge_compares_two_images_for_win_rates(judge, judge_server):
    """Pref-GRPO's comparison through the pairwise reward: two images then the question in one
    request, the verdict read inside <answer>; a tie answer is unparsable (an error, or the
    fallback 0.5 that Pref-GRPO uses)."""
    levels = torch.tensor([0.2, 0.9, 0.5]).reshape(3, 1, 1, 1).expand(3, 3, 24, 24).contiguous()
    judge_server.requests.clear()
    reward = registry.create("reward", "pairwise", judge=judge(parse="pairwise"))
    result = reward(levels, ["a caption"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(result.scores, torch.tensor([0.0, 1.0, 0.5]))
    assert result.details["judge_calls"].tolist() == [3, 3, 3]
    assert len(judge_server.requests) == 3
    content = judge_server.requests[0][2]["messages"][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"] and "「a caption」" in content[2]["text"]
    with pytest.raises(ServiceError, match="hold no score"):
        registry.create("reward", "pairwise", judge=judge(parse="pairwise"))(
            levels, ["tie"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long)
        )
    tied = registry.create("reward", "pairwise", judge=judge(parse="pairwise", fallback=0.5))(
        levels, ["tie"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long)
    )
    assert tied.scores.tolist() == [0.5, 0.5, 0.5] and tied.details["ties"].tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="judge of a pairwise reward"):
        judge(parse="pairwise")(levels, ["a caption"] * 3, [{}] * 3)


def test_edits_send_the_source_then_the_output_with_the_edit_template(judge, judge_server):
    from fgrpo.core import media, scoring
    from fgrpo.core.media import Prompt
    from fgrpo.core.testing import SyntheticImage

    judge_server.requests.clear()
    reward = judge()
    assert reward.accepts_sources
    prompts = [Prompt("good 3", images=(SyntheticImage(1, 24, 24),)), "good 5"]  # an edit, and a plain prompt
    outputs = images(2)

    class Spec:
        label, weight, frame_stride = "judge", 1.0, 1

    scores, _ = scoring.score([(Spec(), reward)], outputs, prompts, [{}, {}], where="test")
    torch.testing.assert_close(scores["judge"], torch.tensor([0.6, 1.0]))
    bodies = sorted((r[2] for r in judge_server.requests), key=lambda b: len(b["messages"][0]["content"]))
    plain, edit = (b["messages"][0]["content"] for b in bodies)
    assert [c["type"] for c in plain] == ["image_url", "text"] and plain[-1]["text"].startswith(
        "You are shown an image generated"
    )
    assert [c["type"] for c in edit] == ["image_url", "image_url", "text"]
    assert edit[-1]["text"].startswith("You are shown two images: the first is the original")
    assert edit[-1]["text"].endswith("Instruction: good 3")
    source = Image.open(io.BytesIO(base64.b64decode(edit[0]["image_url"]["url"].split(",", 1)[1])))
    expected = media.to_tensor(SyntheticImage(1, 24, 24).to_pil(), (16, 16))  # sent at image_size 16
    assert torch.allclose(media.to_tensor(source), expected, atol=2 / 255)
    with pytest.raises(registry.ComponentError, match=r"reward.edit_template: cannot fill"):
        judge(edit_template="{instruction}")

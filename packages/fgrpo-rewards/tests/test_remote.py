"""remote against `fgrpo serve-reward` itself (a real server process on 127.0.0.1), and against
servers that misbehave: slow, malformed, down, wrong token, too large a request."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance
from fgrpo.rewards.http import ServiceError
from fgrpo.rewards.remote import decode_request, encode_request, header_length, open_request, read_header
from fgrpo.rewards.serving import make_server

TOKEN = "s3cret-token"


def start_server(*args, env=None):
    """`fgrpo serve-reward ARGS --port 0`; returns (process, url) once it listens."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fgrpo.core.cli", "serve-reward", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    line = proc.stdout.readline()
    if not line.startswith("serving reward"):
        proc.kill()
        raise AssertionError(f"serve-reward did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split(" on ", 1)[1].split()[0]


@pytest.fixture(scope="module")
def served():
    proc, url = start_server("jpeg-incompressibility", "--set", "quality=80", env={"FGRPO_REWARD_TOKEN": TOKEN})
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def remote(served, monkeypatch):
    monkeypatch.setenv("FGRPO_REWARD_TOKEN", TOKEN)

    def make(**params):
        return registry.create("reward", "remote", **{"url": served, "backoff": 0.01, **params})

    return make


def images(n=4):
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))


class TestRemote(RewardConformance):
    reward_name = "remote"

    @pytest.fixture
    def reward(self, remote):
        return remote()

    def make_inputs(self):
        return images(), ["a", "b", "c", "d"], [{"k": i} for i in range(4)]


@pytest.mark.parametrize("wire", ["uint8", "float32"])
def test_remote_equals_the_reward_in_process(remote, wire):
    local = registry.create("reward", "jpeg-incompressibility", quality=80)
    batch = images(5)
    expected = local(batch, list("abcde"), [{}] * 5)
    got = remote(wire=wire, batch_size=2)(batch, list("abcde"), [{}] * 5)  # three requests
    torch.testing.assert_close(got.scores, expected.scores)
    torch.testing.assert_close(got.details["jpeg_kb"], expected.details["jpeg_kb"])


def test_wire_format_round_trip():
    batch = images(2)
    outputs, prompts, metadata, sources = decode_request(
        encode_request(batch, ["x", "y"], [{"tag": "a"}, {}], "uint8")
    )
    assert (
        torch.equal(outputs, (batch * 255).round() / 255) and prompts == ["x", "y"] and metadata == [{"tag": "a"}, {}]
    )
    assert sources is None
    src = torch.rand(3, 8, 8)
    *_, sources = decode_request(encode_request(batch, ["x", "y"], [{}, {}], "uint8", sources=[(src, src), ()]))
    assert [len(s) for s in sources] == [2, 0] and torch.equal(sources[0][1], (src * 255).round() / 255)
    with pytest.raises(ValueError, match="travel as JSON"):
        encode_request(batch, ["x", "y"], [{"t": torch.zeros(1)}, {}], "uint8")
    vectors = torch.randn(3, 2)  # not images: sent as float32 whatever the wire
    assert torch.equal(decode_request(encode_request(vectors, ["a", "b", "c"], [{}] * 3, "uint8"))[0], vectors)


def with_header(tensors: dict, data: bytes) -> bytes:
    raw = json.dumps({"__metadata__": {"prompts": '["x"]', "metadata": "[{}]"}, **tensors}).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "tensors, data, message",
    [
        ({"outputs": entry("F32", [1, 2], 0, 4)}, b"\0" * 4, "tensor 'outputs': 4 bytes for shape (1, 2) of F32"),
        (
            {"outputs": entry("I64", [1], 0, 8)},
            b"\0" * 8,
            "tensor 'outputs': dtype 'I64'; expected one of U8, F16, F32",
        ),
        ({"outputs": entry("U8", [1, -4], 0, 4)}, b"\0" * 4, "tensor 'outputs': shape [1, -4]; expected"),
        ({"outputs": entry("U8", [1, 8], 0, 8)}, b"\0" * 4, "the tensors take 8 bytes, the body has 4"),
        (  # two tensors on the same bytes
            {"outputs": entry("U8", [1, 4], 0, 4), "source/0/0": entry("U8", [4], 2, 6)},
            b"\0" * 6,
            "tensor 'source/0/0' starts at byte 2, expected 4 (tensors are packed)",
        ),
        ({"outputs": entry("U8", [1], 0, 1), "evil": entry("U8", [1], 1, 2)}, b"\0" * 2, "one tensor 'outputs'"),
    ],
)
def test_a_request_whose_header_does_not_match_its_body_is_refused(tensors, data, message):
    # the server reads tensors in place from what the header declares: every offset is checked
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_request(with_header(tensors, data))


def test_a_header_longer_than_its_body_is_refused():
    body = with_header({"outputs": entry("U8", [1], 0, 1)}, b"\0")
    with pytest.raises(ValueError, match="the safetensors header claims 1000 bytes of a 20-byte body"):
        header_length((1000).to_bytes(8, "little"), 20)
    assert header_length(body, len(body)) == len(body) - 9


def test_a_request_is_read_in_place_not_copied():
    body = bytearray(encode_request(torch.zeros(1, 3, 4, 4), ["x"], [{}], "uint8"))
    length = header_length(body, len(body))
    request = open_request(body, read_header(body[8 : 8 + length], len(body)))
    body[-1] = 255  # the last pixel, written in the body after decoding
    assert request.outputs.dtype == torch.uint8 and request.outputs[0, 2, 3, 3] == 255 and request.scale == 255.0


def test_health_names_the_served_reward(remote):
    reward = remote(serves="jpeg-incompressibility")
    assert reward._served == {"reward": "jpeg-incompressibility", "params": {"quality": 80}, "accepts_sources": False}
    assert not reward.accepts_sources
    with pytest.raises(ServiceError, match=r"reward.serves: .* serves 'jpeg-incompressibility', not 'pickscore'"):
        remote(serves="pickscore")


def test_wrong_or_missing_token_is_refused(remote, monkeypatch):
    monkeypatch.setenv("FGRPO_REWARD_TOKEN", "guess")
    with pytest.raises(ServiceError, match=r"refused the token \(HTTP 401"):
        remote()
    monkeypatch.delenv("FGRPO_REWARD_TOKEN")
    with pytest.raises(ServiceError, match=r"HTTP 401"):
        remote()


def test_server_down():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServiceError, match=rf"cannot reach http://127.0.0.1:{port}/health .*after 1 retry"):
        registry.create("reward", "remote", url=f"http://127.0.0.1:{port}", retries=1, backoff=0.01)


@pytest.fixture
def silent_server():
    """Accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_slow_server_times_out(silent_server):
    start = time.perf_counter()
    with pytest.raises(ServiceError, match=r"no answer within 0.2 s, after 1 retry"):
        registry.create("reward", "remote", url=silent_server, timeout=0.2, retries=1, backoff=0.01)
    assert time.perf_counter() - start < 3


class Garbage(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _garbage(self):
        self.send_response(200)
        body = b'{"reward": "fake"}' if self.path == "/health" else b"not safetensors"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _garbage

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._garbage()


def serve_in_thread(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_malformed_answer_is_an_error():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    try:
        reward = registry.create("reward", "remote", url=serve_in_thread(server), retries=0)
        with pytest.raises(ServiceError, match="answered something that is not a reward result"):
            reward(images(1), ["a"], [{}])
    finally:
        server.shutdown()
        server.server_close()


def test_request_size_limit_and_reward_errors_come_back_as_messages():
    server = make_server("jpeg-compressibility", {}, "127.0.0.1", 0, token=None, max_bytes=2000)
    try:
        url = serve_in_thread(server)
        reward = registry.create("reward", "remote", url=url, retries=0, token_env=None)
        assert reward(images(1)[:, :, :8, :8], ["a"], [{}]).scores.shape == (1,)  # 192 bytes of pixels
        with pytest.raises(ServiceError, match=r"HTTP 413: request of \d+ bytes; the limit is 2000"):
            reward(images(4), list("abcd"), [{}] * 4)  # 3 kB of pixels
        with pytest.raises(
            ServiceError, match=r"HTTP 500: reward 'jpeg-compressibility' failed: ValueError: expected images"
        ):
            reward(torch.rand(2, 5), ["a", "b"], [{}, {}])
    finally:
        server.shutdown()
        server.server_close()


def test_any_other_address_needs_a_token(monkeypatch, capsys):
    from fgrpo.core.cli import main

    monkeypatch.delenv("FGRPO_REWARD_TOKEN", raising=False)
    assert main(["serve-reward", "jpeg-compressibility", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host: got '0.0.0.0', reachable from other machines; set a shared token in $FGRPO_REWARD_TOKEN" in err
    assert main(["serve-reward", "jpeg-compressibility", "--set", "qualty=80"]) == 2
    assert "reward.qualty: unknown key (did you mean 'quality'?)" in capsys.readouterr().err


def test_a_served_edit_reward_gets_the_sources(clip_folder, offline):
    """image-similarity served in another thread: the client learns from /health that it takes the
    sources, the trainer hands them over, and they travel with the batch (float32: exact)."""
    import threading

    from fgrpo.core import media, scoring
    from fgrpo.core.media import Prompt
    from fgrpo.core.testing import SyntheticImage

    server = make_server(
        "image-similarity", {"path": str(clip_folder), "device": "cpu"}, "127.0.0.1", 0, None, 1 << 26
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = registry.create("reward", "remote", url=url, wire="float32", token_env=None, batch_size=2)
        assert client.accepts_sources
        prompts = [Prompt(f"edit {i}", images=(SyntheticImage(i, 32, 32),)) for i in range(3)]
        outputs = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))

        class Spec:
            label, weight, frame_stride = "similar", 1.0, 1

        got, _ = scoring.score([(Spec(), client)], outputs, prompts, [{}] * 3, where="test")
        local = registry.create("reward", "image-similarity", path=str(clip_folder), device="cpu")
        expected = local(outputs, prompts, [{}] * 3, sources=media.reward_sources(prompts, outputs)).scores
        torch.testing.assert_close(got["similar"], expected, atol=1e-6, rtol=0)
    finally:
        server.shutdown()
        server.server_close()

"""Multimodal models over the real server: gRPC image and audio parts and OpenAI image_url data
URLs, with the encoder colocated in the LLMServer's engine and as its own EncoderServer
deployment (LLaVA: each its own Serve application on the session's cluster).

- Greedy answers equal HF's model classes token for token: LLaVA (encoder colocated and as a
  deployment; one image, two images, an image in the second turn of a chat, text alone), and
  LLaVA-NeXT and Qwen2-Audio (the EncoderServer and the Ingress with its engine in this process;
  the same with audio clips, also as OpenAI input_audio).
- The same image twice: encoded once (encoder cache) and its prefix served from the prefix cache;
  another image with the same text shares nothing. Counted in /v1/pagoda/stats and in metrics.
- Every kind of bad media gets INVALID_ARGUMENT / 400 naming its part, and leaves no block held.
"""

from __future__ import annotations

import base64
import time

import grpc
import pytest
import requests

from cluster.serve.grpc_convert import grpc_messages
from protos import inference_pb2 as pb
from tests.hf_reference import check_all
from tests.in_process_ingress import GrpcError
from tests.multimodal.conftest import FAMILIES, MAX_TOKENS
from tests.multimodal.models import blank_image, image_conversations, png, silence, wav
from tests.served_apps import deployed, scrape_until


MAX_MEDIA_BYTES = 64 << 10


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def llava_app(request, serve_cluster, llava_dir):
    placement = request.param
    with deployed({**serve_cluster, "model_dir": llava_dir}, f"llava-{placement}", f"/llava-{placement}",
                  engine={"encoder": placement}, limits={"max_media_items": 3, "max_media_bytes": MAX_MEDIA_BYTES},
                  encoder_server={"ray_actor_options": {"num_cpus": 0}}) as app:
        yield {**app, "placement": placement}


def greedy_request(conversation: list[dict]) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=grpc_messages(conversation),
                              sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))


def generate(app, conversation: list[dict]) -> list[int]:
    responses = app["stub"].Generate(greedy_request(conversation), metadata=app["metadata"], timeout=300)
    return [t for r in responses for t in r.token_ids]


def stats(app) -> dict:
    return requests.get(f"{app['http']}/v1/pagoda/stats", timeout=60).json()


def in_process_stats(client) -> dict:
    return client.http.get("/v1/pagoda/stats").json()


def wait_all_blocks_free(app, timeout_s: float = 60, read=stats) -> dict:
    deadline = time.monotonic() + timeout_s
    while (s := read(app))["kv_blocks_free"] != s["kv_blocks_total"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return s


def test_grpc_answers_equal_hf(llava_app, llava_references):
    answers = [generate(llava_app, c) for c in image_conversations().values()]
    check_all(answers, list(llava_references.values()))


def test_model_info_names_the_image_modality(llava_app):
    info = llava_app["stub"].GetModelInfo(pb.GetModelInfoRequest(), metadata=llava_app["metadata"], timeout=60)
    assert list(info.modalities) == ["text", "image"]


def test_same_image_is_encoded_once_and_hits_the_prefix_cache(llava_app):
    def ask(seed):
        return [{"role": "user", "content": [{"type": "image", "data": png(seed)},
                                             {"type": "text", "text": "Name one color in it."}]}]

    before = stats(llava_app)
    first = generate(llava_app, ask(200))
    after_first = wait_all_blocks_free(llava_app)
    other = generate(llava_app, ask(201))
    after_other = wait_all_blocks_free(llava_app)
    assert after_other["prefix_cache_hit_tokens"] == after_first["prefix_cache_hit_tokens"]  # nothing shared
    assert other != first
    assert generate(llava_app, ask(200)) == first
    after_again = wait_all_blocks_free(llava_app)
    assert after_again["prefix_cache_hit_tokens"] - after_other["prefix_cache_hit_tokens"] == 32  # 2 of its 3 blocks
    encoder_before, encoder_after = before["encoder"], after_again["encoder"]
    assert encoder_after["cache_misses"] - encoder_before["cache_misses"] == 2
    assert encoder_after["cache_hits"] - encoder_before["cache_hits"] == 1


def test_media_metrics_are_exported(llava_app, serve_cluster):
    for _ in range(2):  # a miss, then a hit: each counter has something to export, whatever ran before
        generate(llava_app, image_conversations()["one image"])
    placement = f'placement="{llava_app["placement"]}"'

    def missing(text: str) -> list[str]:
        lines = [line for line in text.splitlines() if line.startswith("ray_pagoda_")]
        gaps = [name for name in ("ray_pagoda_encoder_latency_seconds_count", "ray_pagoda_encoder_cache_hits_total",
                                  "ray_pagoda_encoder_cache_misses_total")
                if not any(line.startswith(name) and placement in line for line in lines)]
        if not any(line.startswith("ray_pagoda_media_items_total") and 'modality="image"' in line for line in lines):
            gaps.append('ray_pagoda_media_items_total{modality="image"}')
        return gaps

    scrape_until(serve_cluster["metrics"], missing, timeout_s=30)


BAD_MEDIA = {
    "not an image": (b"hello, I am text", "is not an image"),
    "truncated": (png(5, (64, 64))[:400], "damaged PNG"),
    "a format not taken": (blank_image("GIF"), "GIF image"),
    "over the byte cap": (png(6, (160, 160)), f"at most {MAX_MEDIA_BYTES}"),
    "a decompression bomb": (blank_image("PNG", (6000, 6000), "L"), "6000x6000 pixels"),
}


# Media is checked at the ingress, whatever the encoder's placement: these run on one of the apps.
ONE_PLACEMENT = pytest.mark.parametrize("llava_app", ["deployment"], indirect=True)


@ONE_PLACEMENT
@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_invalid_argument_naming_its_part(llava_app, case):
    data, reason = BAD_MEDIA[case]
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "data": data}]}]
    with pytest.raises(grpc.RpcError) as error:
        generate(llava_app, conversation)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].parts[1].image" in error.value.details() and reason in error.value.details()
    s = wait_all_blocks_free(llava_app)
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


@ONE_PLACEMENT
def test_audio_and_too_many_images_are_refused(llava_app):
    for content, where, reason in [
        ([{"type": "audio", "data": silence("WAV")}], "messages[0].parts[0].audio", "takes image, not audio"),
        ([{"type": "image", "data": png(i)} for i in range(4)], "messages[0].parts[3].image", "at most 3"),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            generate(llava_app, [{"role": "user", "content": content}])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert where in error.value.details() and reason in error.value.details()
    assert generate(llava_app, image_conversations()["one image"])  # still serving


@ONE_PLACEMENT
def test_openai_image_url_data_urls(llava_app, llava_dir, llava_references):
    url = "data:image/png;base64," + base64.b64encode(png(1)).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in this picture?"}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    r = requests.post(f"{llava_app['http']}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    expected = tokenizer.decode(llava_references["one image"].token_ids, skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == expected
    for part, param in [({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url.url"),
                        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "image_url.url"),
                        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "input_audio.format")]:
        r = requests.post(f"{llava_app['http']}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": [part]}], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[0].content[0].{param}", r.text



@pytest.fixture
def family_ingress(checkpoints, family):
    """The Ingress with its engine in this process (tests/in_process_ingress.py) and an EncoderServer
    beside it, called as the pipeline calls the deployment (in_process.LocalHandle): the family's
    processor, encoder and template are what is tested here; the Ray hop between the EncoderServer
    and the Ingress, the same for every family, is the llava "deployment" app's above."""
    from cluster.serve.encoder_server import EncoderServer
    from cluster.serve.in_process import LocalHandle
    from tests.in_process_ingress import InProcessIngress

    model_dir = checkpoints.dir(family)
    client = InProcessIngress(model_dir, engine={"encoder": "deployment"}, limits={"max_audio_seconds": 2},
                              encoder_server=LocalHandle(EncoderServer(model_dir)))
    yield client
    client.close()


def generate_in_process(client, conversation: list[dict]) -> list[int]:
    return [t for r in client.grpc("Generate", greedy_request(conversation)) for t in r.token_ids]


@pytest.mark.ray  # a served model: make test only
@pytest.mark.parametrize("family", ["llava_next", "qwen2_audio"])
def test_other_families_over_grpc_with_the_encoder_deployment(family_ingress, checkpoints, family):
    client = family_ingress
    references = checkpoints.references(family)
    answers = [generate_in_process(client, c) for c in FAMILIES[family][2]().values()]
    check_all(answers, list(references.values()))
    info = client.grpc("GetModelInfo", pb.GetModelInfoRequest())
    modality = "audio" if family == "qwen2_audio" else "image"
    assert list(info.modalities) == ["text", modality]
    assert in_process_stats(client)["encoder"]["cache_misses"] > 0  # encoded by the EncoderServer
    if modality == "audio":  # the first clip once more, as OpenAI input_audio
        from transformers import AutoTokenizer

        clip = FAMILIES[family][2]()["one clip"][0]["content"]
        body = {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip[0]["data"]).decode(), "format": "wav"}},
            {"type": "text", "text": clip[1]["text"]}]}], "max_tokens": MAX_TOKENS, "temperature": 0}
        r = client.http.post("/v1/chat/completions", json=body)
        expected = AutoTokenizer.from_pretrained(checkpoints.dir(family)).decode(
            references["one clip"].token_ids, skip_special_tokens=True)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected, r.text
        for data, reason in [(wav(9, seconds=3.0), "3.0 s of audio; this server takes at most 2 s"),
                             (b"RIFF....WAVEfmt ", "is not audio"), (png(1), "is not audio")]:
            with pytest.raises(GrpcError) as error:
                generate_in_process(client, [{"role": "user", "content": [{"type": "audio", "data": data}]}])
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "messages[0].parts[0].audio" in error.value.details and reason in error.value.details
        s = wait_all_blocks_free(client, read=in_process_stats)
        assert s["kv_blocks_free"] == s["kv_blocks_total"]

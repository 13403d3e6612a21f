"""LoRA adapters over the API: each is a model of its own name (vLLM's --lora-modules),
listed by /v1/models with its base as parent, named by the responses it answers."""

from __future__ import annotations

import asyncio
import multiprocessing

import httpx
import openai
import pytest

from engine.models.loader import load_tokenizer
from engine.sampling_params import SamplingParams
from server.app import build_engine
from server.async_engine import AsyncEngine
from server.cli import parse_configs
from server.config import ServerConfig
from server.engine_process import spawn_engine
from server.errors import APIError
from server.metrics import Metrics, MetricsShare
from server.serving import Serving
from tests.reference import peft_greedy
from tests.server.live_server import engine_config
from tests.tiny_checkpoints import build_lora


@pytest.fixture
def oai(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x", max_retries=0)


def test_models_lists_each_adapter_under_its_base(oai, tiny_llama_dir, tiny_lora_adapters):
    base = tiny_llama_dir.rstrip("/").rsplit("/", 1)[-1]
    cards = {m.id: m for m in oai.models.list().data}
    assert list(cards) == [base, "all", "qv"]
    assert cards["all"].parent == base and cards["all"].root == tiny_lora_adapters["all"]
    assert getattr(cards[base], "parent", None) is None
    assert oai.models.retrieve("qv").parent == base


def test_a_completion_with_an_adapters_name_generates_with_it(
    oai, tiny_llama_dir, tiny_lora_adapters
):
    prompt = "Once upon a time"
    ids = load_tokenizer(tiny_llama_dir).encode(prompt)
    for name in ("all", "qv"):
        out = oai.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.model == name
        want = peft_greedy(tiny_llama_dir, tiny_lora_adapters[name], ids, 8)
        assert out.choices[0].token_ids == want


def test_a_streamed_chat_names_the_adapter_in_every_chunk(oai):
    stream = oai.chat.completions.create(
        model="qv",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
    )
    assert {chunk.model for chunk in stream} == {"qv"}


def test_an_unknown_model_is_a_404(lora_server):
    r = httpx.post(
        f"{lora_server.base_url}/v1/completions",
        json={"model": "other", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_the_flag_takes_name_equals_dir_and_vllms_json():
    engine, _ = parse_configs(
        ["--lora-modules", "a=/adapters/a", '{"name": "b", "path": "/adapters/b"}', "--enable-lora"]
    )
    assert engine.lora_modules == {"a": "/adapters/a", "b": "/adapters/b"}
    for bad in (["a"], ["a=/x", "a=/y"], ['{"name": "a"}']):
        with pytest.raises(SystemExit):
            parse_configs(["--lora-modules", *bad])


def test_an_adapter_loads_and_unloads_while_serving(
    lora_server, oai, tmp_path, tiny_llama_dir, tiny_lora_adapters
):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: answers in its words."""
    extra = build_lora(tiny_llama_dir, tmp_path / "extra", 7, r=4, target_modules=["o_proj"])
    url = lora_server.base_url

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/{path}", json=body, timeout=60)

    def refused(body: dict, text: str) -> None:
        r = post("load_lora_adapter", body)
        error = r.json()["error"]
        assert r.status_code == 400 and (text in error["message"] or text == error["param"])

    base = tiny_llama_dir.rstrip("/").rsplit("/", 1)[-1]
    refused({"lora_name": base, "lora_path": extra}, "the base model's name")
    refused({"lora_name": "x", "lora_path": str(tmp_path)}, "adapter_config.json")
    refused({"lora_name": "x"}, "lora_path")

    r = post("load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'extra' added successfully."
    cards = {m.id: m for m in oai.models.list().data}
    assert list(cards)[-1] == "extra" and cards["extra"].root == extra
    ids = load_tokenizer(tiny_llama_dir).encode("Once upon a time")
    out = oai.completions.create(
        model="extra",
        prompt=ids,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert out.model == "extra"
    assert out.choices[0].token_ids == peft_greedy(tiny_llama_dir, extra, ids, 6)
    refused({"lora_name": "extra", "lora_path": extra}, "'extra' has already been loaded")
    refused({"lora_name": "x", "lora_path": tiny_lora_adapters["all"]}, "all 3 LoRA")
    # vLLM's load_inplace: the name gets the new weights.
    qv = tiny_lora_adapters["qv"]
    r = post("load_lora_adapter", {"lora_name": "extra", "lora_path": qv, "load_inplace": True})
    assert r.status_code == 200 and {m.id: m.root for m in oai.models.list().data}["extra"] == qv
    out = oai.completions.create(
        model="extra", prompt=ids, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert out.choices[0].token_ids == peft_greedy(tiny_llama_dir, qv, ids, 6)

    r = post("unload_lora_adapter", {"lora_name": "extra"})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'extra' removed successfully."
    assert [m.id for m in oai.models.list().data] == [base, "all", "qv"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="extra", prompt="hi", max_tokens=2)
    r = post("unload_lora_adapter", {"lora_name": "extra"})
    assert r.status_code == 404 and "'extra' cannot be found" in r.json()["error"]["message"]


def test_loading_endpoints_are_off_by_default(client, monkeypatch):
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a"}).status_code == 404
    _, server = parse_configs([])
    assert not server.allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    engine, server = parse_configs(["--enable-lora", "--max-loras", "4"])
    assert server.allow_runtime_lora_updating and engine.enable_lora and engine.max_loras == 4


async def test_an_adapter_loaded_through_one_api_process_serves_in_the_other(
    tiny_llama_dir, tiny_lora_adapters
):
    """With --api-server-count 2 the engine process answers the process that asked, and
    every API process learns the adapters served from the engine's reports, or, for a
    name it does not know yet, from a sync with the engine."""
    config = engine_config(tiny_llama_dir, enable_lora=True, max_loras=1)
    process, endpoints = spawn_engine(config, build_engine, num_clients=2)
    buffer = multiprocessing.get_context("spawn").RawArray("d", 2 * Metrics.num_slots())
    engines = [
        AsyncEngine(config, ServerConfig(), Metrics(MetricsShare(buffer, i, 2)), build_engine, e)
        for i, e in enumerate(endpoints)
    ]
    await asyncio.gather(*(e.start() for e in engines))

    def update(api: int, name: str, path: str | None):  # an answer lost would hang
        return asyncio.wait_for(engines[api].update_lora(name, path), timeout=60)

    try:
        path = tiny_lora_adapters["qv"]
        stale = engines[1].stats
        await update(0, "qv", path)
        # The second process as if its reader had not yet taken the load's report in
        # (taken in for sure first, so that it cannot land after): a request naming the
        # adapter there syncs with the engine before a 404.
        await asyncio.wait_for(engines[1].sync(), timeout=60)
        engines[1].stats = stale
        serving = Serving(engines[1], ServerConfig(allow_runtime_lora_updating=True))
        await asyncio.wait_for(serving.check_model("qv"), timeout=60)
        assert serving.lora_modules == {"qv": path}
        with pytest.raises(APIError) as missing:
            await asyncio.wait_for(serving.check_model("other"), timeout=60)
        assert missing.value.status == 404
        ids = load_tokenizer(tiny_llama_dir).encode("Once upon a time")
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name="qv")
        tokens = [
            t
            async for outputs in engines[1].submit("r", [ids], params)
            for out in outputs
            for t in out.new_token_ids
        ]
        assert tokens == peft_greedy(tiny_llama_dir, path, ids, 6)
        served = engines[1].stats.lora_adapters  # reported to both since the load
        assert [(a.name, a.path) for a in served] == [("qv", path)]
        with pytest.raises(APIError) as refused:  # the one slot is taken
            await update(1, "all", tiny_lora_adapters["all"])
        assert refused.value.status == 400 and "all 1 LoRA adapter slots" in str(refused.value)
        with pytest.raises(APIError) as unknown:
            await update(1, "all", None)
        assert unknown.value.status == 404
        await update(1, "qv", None)
        assert engines[1].stats.lora_adapters == ()
    finally:
        for engine in engines:
            await engine.shutdown(timeout=30)
    process.join(30)


def test_metrics_name_the_adapters_as_vllms_lora_requests_info(lora_server):
    text = httpx.get(f"{lora_server.base_url}/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("pagoda:lora_requests_info{")]
    assert 'max_lora="3"' in line and 'running_lora_adapters=""' in line
    assert float(line.rsplit(" ", 1)[1]) > 1.7e9  # the scrape's time, as vLLM's

"""Flags → EngineConfig/ServerConfig, and the `pagoda` subcommands."""

from __future__ import annotations

import shlex
import subprocess
import sys
import types

import pytest

from engine.config import EngineConfig
from server import cli
from server.http_server import uvicorn_config


def test_defaults_match_the_design():
    engine, server = cli.parse_configs([])
    assert engine.model is None  # the embedded demo model
    assert (server.host, server.port) == ("127.0.0.1", 8000)
    assert engine.enable_prefix_caching and not engine.enforce_eager
    assert engine.async_scheduling and engine.prefill_graphs
    assert server.api_key is None and server.allowed_origins == []
    assert not server.engine_process  # the engine thread, as the design says
    assert server.api_server_count == 1
    assert server.access_log  # uvicorn's default, as vLLM keeps it
    assert engine.log_stats_interval == 10.0
    assert engine.stream_interval == 1  # every token, as vLLM and SGLang stream


def test_every_flag_maps_to_its_field():
    argv = shlex.split(
        "--model /m --host 0.0.0.0 --port 9001 --device cpu --dtype bfloat16 --block-size 32 "
        "--num-kv-blocks 100 --gpu-memory-utilization 0.5 --max-num-seqs 8 "
        "--max-num-batched-tokens 512 --max-model-len 1024 --served-model-name demo "
        "--api-key k --enforce-eager --no-prefill-graphs --no-prefix-caching --no-async-scheduling --seed 7 --nvtx "
        "--allowed-origins http://a http://b --max-waiting-requests 5 "
        "--max-request-body-bytes 1000 --shutdown-timeout 2 --log-level debug --engine-process --api-server-count 3 "
        "--disable-uvicorn-access-log --disable-log-stats --stream-interval 4 "
        "--header-timeout 3 --body-timeout 4 --timeout-keep-alive 6 --max-connections 9 "
        "--cuda-graph-sizes 1 4 16 --pooling-type mean"
    )
    engine, server = cli.parse_configs(argv)
    assert (engine.model, engine.device, engine.dtype, engine.block_size) == (
        "/m",
        "cpu",
        "bfloat16",
        32,
    )
    assert (engine.num_kv_blocks, engine.gpu_memory_utilization) == (100, 0.5)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len) == (
        8,
        512,
        1024,
    )
    assert engine.enforce_eager and not engine.enable_prefix_caching
    assert not engine.async_scheduling and not engine.prefill_graphs
    assert (engine.seed, engine.nvtx, engine.log_stats_interval) == (7, True, 0.0)
    assert engine.stream_interval == 4
    assert engine.cuda_graph_sizes == [1, 4, 16]
    assert engine.pooling_type == "MEAN"
    assert (server.host, server.port, server.served_model_name, server.api_key) == (
        "0.0.0.0",
        9001,
        "demo",
        "k",
    )
    assert server.allowed_origins == ["http://a", "http://b"]
    assert (server.max_waiting_requests, server.max_request_body_bytes) == (5, 1000)
    assert (server.shutdown_timeout, server.log_level) == (2.0, "debug")
    assert server.engine_process and server.api_server_count == 3
    assert not server.access_log
    assert (server.header_timeout, server.body_timeout, server.timeout_keep_alive) == (3, 4, 6)
    assert server.max_connections == 9


def test_the_stats_line_interval_is_a_flag_and_disabling_wins():
    engine, _ = cli.parse_configs(["--log-stats-interval", "2.5"])
    assert engine.log_stats_interval == 2.5
    engine, _ = cli.parse_configs(["--log-stats-interval", "2.5", "--disable-log-stats"])
    assert engine.log_stats_interval == 0.0


def test_uvicorn_gets_the_server_settings():
    _, server = cli.parse_configs(shlex.split("--port 9002 --shutdown-timeout 3"))
    config = uvicorn_config(object(), server)
    # uvicorn's own deadline comes after ours: streams end with an error event first.
    assert (config.port, config.timeout_graceful_shutdown, config.access_log) == (9002, 8, True)
    _, quiet = cli.parse_configs(["--disable-uvicorn-access-log"])
    assert uvicorn_config(object(), quiet).access_log is False


def test_several_api_servers_imply_the_engine_process():
    _, server = cli.parse_configs(["--api-server-count", "2"])
    assert server.engine_process


def test_invalid_values_exit_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_configs(["--block-size", "3"])
    assert exc.value.code == 2
    assert "block_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_configs(["--api-server-count", "0"])
    assert "api_server_count must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_configs(["--stream-interval", "0"])
    assert "stream_interval must be at least 1" in capsys.readouterr().err


def test_fp8_flags_map_to_their_fields_and_are_off_by_default():
    engine, _ = cli.parse_configs([])
    assert (engine.quantization, engine.kv_cache_dtype) == (None, "auto")
    argv = ["--device", "cuda", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    engine, _ = cli.parse_configs(argv)  # the device is checked when the engine starts
    assert (engine.quantization, engine.kv_cache_dtype) == ("fp8", "fp8")


@pytest.mark.parametrize("flags", [["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"]])
def test_fp8_on_cpu_is_refused_at_startup(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_configs(["--device", "cpu", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "need a CUDA GPU with FP8 support" in err and "the device here is the CPU" in err


def test_unknown_fp8_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        cli.parse_configs(["--quantization", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int8")


def test_tensor_parallel_flags_map_to_their_fields():
    argv = shlex.split(
        "-tp 4 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --headless "
        "--disable-custom-all-reduce"
    )
    engine, server = cli.parse_configs(argv)
    assert (engine.tensor_parallel_size, engine.nnodes, engine.node_rank) == (4, 2, 1)
    assert not engine.custom_all_reduce
    assert (engine.master_addr, engine.master_port, engine.ranks_per_node) == ("10.0.0.1", 29500, 2)
    assert server.headless
    engine, server = cli.parse_configs(["--tensor-parallel-size", "2"])
    assert engine.tensor_parallel_size == 2 and engine.nnodes == 1 and not server.headless
    assert engine.custom_all_reduce  # small sums one-shot unless told otherwise


@pytest.mark.parametrize(
    "argv, message",
    [
        ("-tp 3 --nnodes 2 --master-port 1", "does not divide evenly"),
        ("-tp 2 --nnodes 2", "--master-port"),
        ("-tp 2 --nnodes 2 --node-rank 1 --master-port 1", "--headless"),
        ("-tp 2 --nnodes 2 --master-port 1 --headless", "--node-rank"),
        ("-tp 2 --nnodes 2 --node-rank 2 --master-port 1 --headless", "node_rank"),
        ("-tp 0", "tensor_parallel_size"),
    ],
)
def test_inconsistent_tensor_parallel_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.parse_configs(shlex.split(argv))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_loadtest_delegates(monkeypatch):
    seen = {}
    fake = types.ModuleType("clients.loadtest")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "clients.loadtest", fake)
    assert cli.main(["loadtest", "--num-requests", "3"]) == 0
    assert seen["argv"] == ["--num-requests", "3"]


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert cli.main([]) == 2


@pytest.mark.parametrize(
    "code",
    [
        "import engine",
        "from server.cli import main; main(['--help'])",
        "from server.cli import main; main(['serve', '--help'])",
        "import server.app, server.api_servers",
    ],
)
def test_import_and_help_do_not_load_torch(code):
    """`import engine`, `pagoda --help`, `pagoda serve --help` and an API process before
    its tokenizer need neither torch nor transformers (seconds of imports, and the
    engine process's start waits for the API process's)."""
    check = (
        "import sys; assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    program = f"import contextlib\nwith contextlib.suppress(SystemExit):\n    {code}\n{check}"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_tool_flags():
    _, server = cli.parse_configs(
        ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert server.enable_auto_tool_choice and server.tool_call_parser == "llama3_json"
    _, server = cli.parse_configs([])
    assert not server.enable_auto_tool_choice and server.tool_call_parser is None
    for argv in (["--enable-auto-tool-choice"], ["--tool-call-parser", "xlam"]):
        with pytest.raises(SystemExit):
            cli.parse_configs(argv)


def test_speculative_flags_and_vllms_json_form():
    engine, _ = cli.parse_configs(["--num-speculative-tokens", "4", "--prompt-lookup-max", "3"])
    assert (engine.num_speculative_tokens, engine.prompt_lookup_min) == (4, 3)
    assert not engine.async_scheduling
    spec = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    engine, _ = cli.parse_configs(["--speculative-config", spec])
    assert (engine.num_speculative_tokens, engine.prompt_lookup_max) == (5, 4)
    engine, _ = cli.parse_configs([])
    assert engine.num_speculative_tokens == 0 and engine.async_scheduling


@pytest.mark.parametrize(
    "spec, message",
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "n-gram lookup only"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 3, "model": "x"}', "unsupported --speculative-config keys"),
        ('{"num_speculative_tokens": "3"}', "must be integers"),
        ("[3]", "expected a JSON object"),
    ],
)
def test_speculative_configs_pagoda_cannot_run_are_usage_errors(spec, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_configs(["--speculative-config", spec])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_limit_mm_per_prompt_takes_vllms_json(capsys):
    _, server = cli.parse_configs(["--limit-mm-per-prompt", '{"image": 2, "video": 0}'])
    assert server.max_images_per_prompt == 2
    assert cli.parse_configs([])[1].max_images_per_prompt is None
    for bad in ('{"image": -1}', '{"video": 1}', "[2]", "{image: 2}", '{"image": true}'):
        with pytest.raises(SystemExit):
            cli.parse_configs(["--limit-mm-per-prompt", bad])
    assert "--limit-mm-per-prompt" in capsys.readouterr().err


def test_media_flags_name_hosts_and_an_existing_directory(tmp_path, capsys):
    argv = ["--allowed-media-domains", "a.example", "B.example"]
    _, server = cli.parse_configs([*argv, "--allowed-local-media-path", str(tmp_path)])
    assert server.allowed_media_domains == ["a.example", "B.example"]
    assert server.allowed_local_media_path == str(tmp_path)
    with pytest.raises(SystemExit):
        cli.parse_configs(["--allowed-local-media-path", str(tmp_path / "nowhere")])
    assert "is not a directory" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert cli.parse_configs(["--chat-template", str(path)])[1].chat_template == path.read_text()
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert cli.parse_configs(["--chat-template", inline])[1].chat_template == inline
    with pytest.raises(SystemExit):
        cli.parse_configs(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "neither a file nor a Jinja template" in capsys.readouterr().err

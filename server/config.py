"""ServerConfig: the HTTP side's settings (the engine's live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from server.parser_names import PARSERS
from server.reasoning import PARSERS as REASONING_PARSERS

# auto: the model's generation_config.json sets the sampling defaults; vllm: it does not.
GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# vLLM's switch for its adapter-loading endpoints, honoured as --allow-runtime-lora-updating.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # None: no auth
    allowed_origins: list[str] = field(default_factory=list)  # empty: CORS off
    max_waiting_requests: int = 1024  # past this many queued requests, 503
    max_request_body_bytes: int = 16 * 1024 * 1024
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    # Slow or idle clients (server/http_server.py): seconds from a connection's opening
    # (or its last response) to its request's headers, and from those to its body.
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    timeout_keep_alive: float = 5.0  # an idle kept-alive connection (uvicorn's)
    max_connections: int = 4096  # open connections past which new ones get 503
    log_level: str = "info"
    # The fields below are documented by their flags' help (server/cli.py, server/flags.py).
    access_log: bool = True  # uvicorn's line per request, a cost on a busy event loop
    engine_process: bool = False  # server/engine_process.py
    api_server_count: int = 1  # server/api_servers.py; > 1 implies engine_process
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # server/tool_parsers.py
    reasoning_parser: str | None = None  # server/reasoning.py
    generation_config: str = "auto"  # engine/generation_config.py
    max_images_per_prompt: int | None = None  # --limit-mm-per-prompt's "image"; None: any
    allowed_media_domains: list[str] | None = None  # server/images.py's MediaAccess
    allowed_local_media_path: str | None = None
    # --chat-template: a file's path or the template itself; the template's text after init
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    allow_runtime_lora_updating: bool = False  # server/lora_admin.py's endpoints
    headless: bool = False  # engine/tp_worker.py's serve_headless

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {self.api_server_count}")
        if self.api_server_count > 1:
            self.engine_process = True
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {tuple(PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.chat_template is not None:
            self.chat_template = _template_text(self.chat_template)
        path = self.allowed_local_media_path
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, "
                f"got {self.generation_config!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be non-negative")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be positive")
        if min(self.header_timeout, self.body_timeout, self.timeout_keep_alive) <= 0:
            raise ValueError("header_timeout, body_timeout and timeout_keep_alive must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


def _template_text(value: str) -> str:
    """vLLM's reading of --chat-template: a file's contents, or the template itself."""
    if Path(value).is_file():
        return Path(value).read_text()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    return value

"""EngineConfig: the one object built from CLI flags and threaded down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is asked for, not with the config
    import torch

    from engine.models.lora_slots import LoRASettings

PREFILL_GRAPH_MAX_TOKENS = 2048
# How a step ran (ModelRunner.steps_by_path), as the server's stats line reports it.
STEP_PATHS = ("graph", "prefill graph", "eager")
_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
POOLING_TYPES = ("LAST", "CLS", "MEAN")  # engine/pooling.py
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# An encoder's default step budget (vLLM's for pooling models): its steps are prompts
# only, and the more a step holds, the fewer launches each token costs.
ENCODER_MAX_NUM_BATCHED_TOKENS = 32768


@dataclass
class EngineConfig:
    model: str | None = None  # local HF directory; None = the embedded demo model
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from free memory
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS (an encoder's: ENCODER_MAX_NUM_BATCHED_TOKENS).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    # None: on, except for a model with recurrent layers (see recurrent_model).
    enable_prefix_caching: bool | None = None
    # "fcfs": requests in arrival order; "priority": by SamplingParams.priority (lower
    # first), then arrival, for admission and (the last of that order) preemption.
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    # The fields below are documented by their flags' help (server/flags.py, server/cli.py).
    prefill_graphs: bool = True  # steps with prefill replay graphs by token bucket
    cuda_graph_sizes: list[int] | None = None  # None: see cuda_graph_batch_sizes
    # Schedule and launch step N+1 before reading step N's sampled ids (vLLM's --async-scheduling).
    async_scheduling: bool = True
    seed: int = 0
    nvtx: bool = False
    log_stats_interval: float = 10.0  # server/engine_loop.py's StatLog; 0: none
    stream_interval: int = 1  # SGLang's --stream-interval
    quantization: str | None = None  # engine/models/quantization.py
    kv_cache_dtype: str = "auto"  # "auto": the model dtype
    # Tensor parallelism (engine/tp_group.py): ranks spread evenly over nnodes machines.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    custom_all_reduce: bool = True  # small sums by engine/one_shot.py (one node, CUDA)
    # LoRA adapters served beside the model (engine/models/lora.py): name -> PEFT directory.
    lora_modules: dict[str, str] | None = None
    # Adapter slots on every projection, so adapters load while serving (vLLM's flag);
    # max_loras: how many adapters are held at once (None: one, or the startup ones).
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = (
        None  # None: the largest adapter's rank (16 at least with enable_lora)
    )
    # Speculative decoding by n-gram lookup (engine/speculative.py): draft tokens per step
    # (0: off), and the n-gram lengths matched (vLLM's prompt_lookup_min/max; either
    # given alone sets both, as in vLLM; neither: 5).
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # How pooling requests pool (engine/pooling.py); None: as the model does.
    pooling_type: str | None = None
    # Set by the engine for an encoder (engine/models/bert.py): see encoder_only().
    encoder: bool = field(default=False, init=False)
    budget_given: bool = field(default=False, init=False)  # max_num_batched_tokens was set
    prefix_caching_given: bool = field(default=False, init=False)
    # Snapshot rows of recurrent states for the prefix cache (engine/state_snapshots.py).
    state_snapshots: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.budget_given = self.max_num_batched_tokens is not None
        self.prefix_caching_given = self.enable_prefix_caching is not None
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")
        if self.log_stats_interval < 0:
            raise ValueError("log_stats_interval must be non-negative")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        for name, choices in (("quantization", QUANTIZATIONS), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        fp8 = self.quantization == "fp8" or self.kv_cache_dtype == "fp8"
        if fp8 and self.torch_device.type == "cpu":
            raise ValueError(
                "--quantization fp8 and --kv-cache-dtype fp8 need a CUDA GPU with FP8 support "
                "(compute capability 8.9+: Ada, Hopper); the device here is the CPU"
            )
        if self.tensor_parallel_size < 1 or self.nnodes < 1:
            raise ValueError("tensor_parallel_size and nnodes must be at least 1")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not divide evenly "
                f"over {self.nnodes} nodes"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        for name in ("max_lora_rank", "max_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_loras is not None and self.max_loras < len(self.lora_modules or ()):
            raise ValueError(
                f"max_loras {self.max_loras} holds fewer adapters than the "
                f"{len(self.lora_modules)} lora_modules names"
            )
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several nodes need a --master-port every node can reach")
        if self.num_speculative_tokens:
            self._check_speculation()

    def _check_speculation(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be non-negative, got {self.num_speculative_tokens}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = low or high or 5, high or low or 5
        if not 1 <= low <= high:
            raise ValueError(
                f"prompt_lookup_min ({low}) must be at least 1 and at most prompt_lookup_max ({high})"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high
        # A step's drafts follow the ids the last step sampled: they are read first.
        self.async_scheduling = False

    def encoder_only(self) -> None:
        """An encoder's settings: every request pools its prompt, which runs whole in one
        step (attention is bidirectional), so no prefix is cached for another prompt and
        no step replays a graph (pooling steps run eagerly). The step budget, unless
        given, is ENCODER_MAX_NUM_BATCHED_TOKENS."""
        if self.num_speculative_tokens:
            raise ValueError("an encoder model generates nothing: no speculative decoding")
        if not self.budget_given:
            self.max_num_batched_tokens = ENCODER_MAX_NUM_BATCHED_TOKENS
        self.encoder = True
        self.enable_prefix_caching = False
        self.enforce_eager = True

    def recurrent_model(self) -> None:
        """A model with recurrent layers (engine/models/layers.py's RecurrentLayer): a
        sequence's state is built token by token, so no step is rolled back
        (speculative decoding), and a cached prefix needs the state saved where it ends:
        the prefix cache, only when asked for, keeps a snapshot row per sequence slot
        (engine/state_snapshots.py)."""
        if self.num_speculative_tokens:
            raise ValueError(
                "speculative decoding is not supported for models with recurrent layers "
                "(their state cannot take back rejected drafts)"
            )
        if not self.prefix_caching_given:
            self.enable_prefix_caching = False
        self.state_snapshots = self.max_num_seqs if self.enable_prefix_caching else 0

    @property
    def whole_pooling_prompts(self) -> bool:
        """Pooling prompts run whole in one step, never from the prefix cache: an
        encoder's, and every prompt CLS or MEAN pooling reads all the states of."""
        return self.encoder or self.pooling_type not in (None, "LAST")

    @property
    def lora(self) -> LoRASettings | None:
        """The adapter slots' settings (engine/models/lora_slots.py); None: no LoRA."""
        if not (self.enable_lora or self.lora_modules):
            return None
        from engine.models.lora_slots import LoRASettings

        adapters = dict(self.lora_modules or {})
        return LoRASettings(adapters, self.max_lora_rank, self.max_loras, self.enable_lora)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def offline_step_budget(self) -> None:
        """The offline LLM's step budget, unless given (offline_budget). An encoder's
        budget still overrides it."""
        if not self.budget_given:
            self.max_num_batched_tokens = offline_budget(self.torch_device)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
        """fp32 on CPU; on CUDA the checkpoint's half type (bf16 if it is fp32)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.torch_device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16

    @property
    def use_cuda_graphs(self) -> bool:
        return self.torch_device.type == "cuda" and not self.enforce_eager

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)

    def cuda_graph_batch_sizes(self) -> list[int]:
        """Decode batch buckets: cuda_graph_sizes below max_num_seqs, else 1, 2, 4, 8,
        then every 8; and max_num_seqs."""
        if self.cuda_graph_sizes is not None:
            sizes = sorted({b for b in self.cuda_graph_sizes if b < self.max_num_seqs})
        else:
            sizes = [b for b in (1, 2, 4) if b < self.max_num_seqs]
            sizes += list(range(8, self.max_num_seqs, 8))
        return sizes + [self.max_num_seqs]

    def cuda_graph_bucket_table(self) -> list[int]:
        """Entry n: the decode bucket a batch of n sequences replays (the smallest that
        holds it), looked up per step instead of searched."""
        sizes = self.cuda_graph_batch_sizes()
        return [min(b for b in sizes if b >= n) for n in range(self.max_num_seqs + 1)]

    def prefill_graph_sizes(self) -> list[int]:
        """Token buckets for steps with prefill: 16 to 256 doubling, then every 256, up to
        max_num_batched_tokens or 2048 (past that a step is GPU-bound: it runs eagerly)."""
        top = min(self.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)
        sizes = [s for s in (16, 32, 64, 128, 256) if s < top] + list(range(512, top, 256))
        return sizes + [top]


def offline_budget(device: torch.device) -> int:
    """The offline LLM's step budget on `device` (engine/llm.py), as vLLM's LLM class
    sets it on a GPU: 16,384 tokens from 70 GiB of memory, 8,192 below. Offline, a step
    is judged by throughput, not by how long it holds back other streams' next tokens:
    larger steps run the prompts' GEMMs and attention in fewer, fuller launches, and
    the decodes beside them are read fewer times. On the CPU the engine's default."""
    if device.type != "cuda":
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    import torch

    memory = torch.cuda.get_device_properties(device).total_memory
    return 16384 if memory >= 70 * 2**30 else 8192

"""Tensor-parallel models: each rank's shard arithmetic and the slices it reads, and TP=2
over two gloo processes giving TP=1's logits for every model family.

One spawned process group per module (the machine has 2 cores): it loads and runs every
checkpoint, and the tests compare its results with TP=1 computed here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.distributed import TensorParallel
from engine.models.layers import (
    AttentionMetadata,
    AttentionOps,
    LMHead,
    PagedAttention,
    RecurrentLayer,
    SequenceSpans,
    allocate_states,
)
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import (
    RANDOM_WEIGHTS_MARKER,
    ModelLoadError,
    iter_weights,
    load_config,
    load_model,
)
from engine.models.parallel import (
    RowParallelLinear,
    TensorSlice,
    VocabParallelEmbedding,
    head_shard,
    kv_heads_of_rank,
)
from tests.introspection import OpLog
from tests.ports import free_port
from tests.tiny_checkpoints import FAMILY_CONFIGS

PROMPT_IDS = [[5, 9, 200, 17, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 300], [450]]
SHARDED_FAMILIES = list(FAMILY_CONFIGS)
DECODE_IDS = [7, 11, 508]
BLOCK_SIZE = 4


def rank_of(rank: int, size: int) -> TensorParallel:
    """A rank's view for shard arithmetic and loading: no process group needed."""
    return TensorParallel(rank, size, None)


# -- shard arithmetic ---------------------------------------------------------


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "size", "per_rank"),
    [
        (4, 2, 2, [[0], [1]]),  # divisible: split
        (4, 4, 2, [[0, 1], [2, 3]]),  # MHA
        (4, 1, 2, [[0], [0]]),  # fewer kv heads than ranks: replicated
        (8, 2, 4, [[0], [0], [1], [1]]),
        (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # a rank's q heads split kv head 1's group
        (8, 8, 1, [list(range(8))]),
    ],
)
def test_kv_heads_of_each_rank(num_heads, num_kv_heads, size, per_rank):
    got = [kv_heads_of_rank(num_heads, num_kv_heads, rank_of(r, size)) for r in range(size)]
    assert got == per_rank
    group = num_heads // num_kv_heads
    for rank, kv_heads in enumerate(got):
        # Local q head j reads local kv head j // (q heads / kv heads), as the kernels do:
        # that must be the kv head global q head start + j reads.
        start, n = rank * num_heads // size, num_heads // size
        for j in range(n):
            assert kv_heads[j // (n // len(kv_heads))] == (start + j) // group


def test_head_shard_rows():
    heads = head_shard(6, 3, 16, rank_of(1, 2))
    q, k, v = heads.sections
    assert (heads.num_heads, heads.kv_heads) == (3, (1, 2, 2))
    assert (q.size, q.ranges) == (96, ((48, 96),))
    assert (k.size, k.ranges) == (48, ((16, 32), (32, 48), (32, 48))) and v == k


def test_shapes_that_do_not_split_are_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="6 attention heads do not divide across 4"):
        kv_heads_of_rank(6, 2, rank_of(0, 4))
    with pytest.raises(
        ModelLoadError, match="config.json: intermediate_size 128 does not divide across 3"
    ):
        load_model(tiny_llama_dir, torch.device("cpu"), torch.float32, tp=rank_of(0, 3))


def traced(fn, *args) -> tuple[torch.Tensor, list[str]]:
    with OpLog() as trace:
        out = fn(*args)
    return out, trace.ops


def test_size_one_layers_run_the_plain_ops():
    """With SINGLE no layer adds an op to what nn.Linear / nn.Embedding ran before."""
    x, ids = torch.randn(3, 64), torch.tensor([0, 5, 99])
    row = RowParallelLinear(64, 32, bias=True)
    embed = VocabParallelEmbedding(100, 64)
    head = LMHead(100, 64)
    torch.nn.init.normal_(head.weight)  # LMHead's weight is torch.empty until loaded
    pairs = [
        (row, lambda x: F.linear(x, row.weight, row.bias), x),
        (embed, lambda i: F.embedding(i, embed.weight), ids),
        (head, lambda x: F.linear(x, head.weight)[:, :100], x),
    ]
    for layer, plain, arg in pairs:
        (got, ops), (want, plain_ops) = traced(layer, arg), traced(plain, arg)
        assert ops == plain_ops and torch.equal(got, want), type(layer).__name__
    assert head.weight.shape == (128, 64)  # padded to 64 rows, as before


# -- slice-only loading ---------------------------------------------------------


class Recorder:
    """Wraps a safetensors slice; counts the elements read through it."""

    def __init__(self, name: str, weight, reads: dict[str, int]) -> None:
        self.name, self.weight, self.reads = name, weight, reads

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, index):
        out = self.weight[index]
        self.reads[self.name] = self.reads.get(self.name, 0) + out.numel()
        return out


def test_a_rank_reads_only_its_slices(tiny_llama_dir):
    with torch.device("meta"):
        model = LlamaForCausalLM(load_config(tiny_llama_dir), rank_of(1, 2))
    model = model.to_empty(device="cpu")
    reads: dict[str, int] = {}
    weights = ((n, Recorder(n, w, reads)) for n, w in iter_weights(tiny_llama_dir))
    model.load_weights(weights)
    full = load_file(f"{tiny_llama_dir}/model.safetensors")
    assert set(reads) == set(full)
    for name, tensor in full.items():
        # Every matrix is split in two (vocab 512: 256 rows each); norms are replicated.
        want = tensor.numel() // 2 if tensor.dim() == 2 else tensor.numel()
        assert reads[name] == want, name


def test_rank_shards_hold_the_checkpoint_rows(tiny_llama_dir, tiny_family_dir):
    cpu, fp32 = torch.device("cpu"), torch.float32
    hf = load_file(f"{tiny_llama_dir}/model.safetensors")
    rank1, _ = load_model(tiny_llama_dir, cpu, fp32, tp=rank_of(1, 2))
    attn, mlp = rank1.layers[0].self_attn, rank1.layers[0].mlp
    p = "model.layers.0"
    q, k, v = (hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")  # 4 q, 2 kv heads of 16
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q[32:], k[16:], v[16:]]))
    assert torch.equal(attn.o_proj.weight, hf[f"{p}.self_attn.o_proj.weight"][:, 32:])
    gate, up = hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(mlp.down_proj.weight, hf[f"{p}.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(rank1.embed_tokens.weight, hf["model.embed_tokens.weight"][256:])
    assert rank1.embed_tokens.vocab_start == 256

    # Phi-3 ships qkv and gate_up fused: the rank's rows come from inside those tensors.
    phi3_dir = tiny_family_dir("phi3")
    hf = load_file(f"{phi3_dir}/model.safetensors")
    whole, _ = load_model(phi3_dir, cpu, fp32)
    rank1, _ = load_model(phi3_dir, cpu, fp32, tp=rank_of(1, 2))
    qkv = hf[f"{p}.self_attn.qkv_proj.weight"]  # [q 64 | k 32 | v 32, hidden]
    # It rotates 12 of 16 dims a head: each q and k head's rows in the kernels' order.
    order = whole.rotary.dim_order
    q, k = (x.view(-1, 16, x.shape[1])[:, order].flatten(0, 1) for x in (qkv[:64], qkv[64:96]))
    assert torch.equal(whole.layers[0].self_attn.qkv_proj.weight, torch.cat([q, k, qkv[96:]]))
    want = torch.cat([q[32:], k[16:], qkv[112:128]])
    assert torch.equal(rank1.layers[0].self_attn.qkv_proj.weight, want)
    gate_up = hf[f"{p}.mlp.gate_up_proj.weight"]  # [gate 128 | up 128, hidden]
    want = torch.cat([gate_up[64:128], gate_up[192:]])
    assert torch.equal(rank1.layers[0].mlp.gate_up_proj.weight, want)


def test_gpt2_conv1d_shards(tiny_gpt2_dir):
    hf = load_file(f"{tiny_gpt2_dir}/model.safetensors")
    rank1, _ = load_model(tiny_gpt2_dir, torch.device("cpu"), torch.float32, tp=rank_of(1, 2))
    block = rank1.h[0]
    c_attn = hf[
        "transformer.h.0.attn.c_attn.weight"
    ].t()  # Conv1D [in, out] -> [out, in]: q, k, v of 64
    assert torch.equal(
        block.c_attn.weight, torch.cat([c_attn[32:64], c_attn[96:128], c_attn[160:]])
    )
    assert torch.equal(block.c_proj.weight, hf["transformer.h.0.attn.c_proj.weight"].t()[:, 32:])
    assert torch.equal(block.c_fc.bias, hf["transformer.h.0.mlp.c_fc.bias"][128:])
    assert torch.equal(block.mlp_proj.weight, hf["transformer.h.0.mlp.c_proj.weight"].t()[:, 128:])
    # Row-parallel biases are added once: by rank 0.
    assert not block.c_proj.bias.any() and not block.mlp_proj.bias.any()
    assert torch.equal(rank1.wpe.weight, hf["transformer.wpe.weight"])  # positions: replicated


def test_a_tensor_of_the_wrong_shape_is_named_not_sliced(tmp_path, tiny_llama_dir):
    # A rank's rows of a too-large tensor would fit its shard: the full shape is checked.
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    name = "layers.1.self_attn.k_proj.weight"
    weights[f"model.{name}"] = torch.cat([weights[f"model.{name}"]] * 2)
    save_file(weights, model_dir / "model.safetensors")
    match = rf"weights do not fit the config: {name}: shape \(64, 64\), expected \(32, 64\)"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(model_dir), torch.device("cpu"), torch.float32, tp=rank_of(0, 2))


def test_vocab_shares_with_padding_only(tiny_gpt2_dir):
    # LM-head shares are 64 rows: over 8 ranks they hold the 512 ids exactly, over 16
    # the shares past id 512 are all padding. The embedding splits 512 rows evenly.
    hf = load_file(f"{tiny_gpt2_dir}/model.safetensors")["transformer.wte.weight"]
    for rank, size in [(7, 8), (9, 16), (15, 16)]:
        head = LMHead(512, 64, tp=rank_of(rank, size))
        embed = VocabParallelEmbedding(512, 64, rank_of(rank, size))
        head.load_shard("weight", TensorSlice(hf), None)
        embed.load_shard("weight", TensorSlice(hf), None)
        assert head.weight.shape == (64, 64) and head.vocab_start == 64 * rank
        stop = min(64 * rank + 64, 512)
        assert torch.equal(head.weight[: max(0, stop - 64 * rank)], hf[64 * rank : stop])
        assert not head.weight[max(0, stop - 64 * rank) :].any()
        rows = 512 // size
        assert torch.equal(embed.weight, hf[rank * rows : (rank + 1) * rows])


def test_random_weight_checkpoints_build_the_shard_shapes(tmp_path, tiny_family_dir):
    model_dir = shutil.copytree(tiny_family_dir("qwen3_moe"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    (model_dir / RANDOM_WEIGHTS_MARKER).write_text("")
    rank1, _ = load_model(str(model_dir), torch.device("cpu"), torch.float32, tp=rank_of(1, 2))
    attn, moe = rank1.layers[0].self_attn, rank1.layers[0].mlp
    assert attn.qkv_proj.weight.shape == (32 + 16 + 16, 64)  # 2 of 4 q heads, 1 of 2 kv
    assert moe.w13.shape == (8, 2 * 16, 64) and moe.w2.shape == (8, 64, 16)
    assert rank1.lm_head.weight.shape == (256, 64) and torch.isfinite(moe.w13).all()


# -- TP=2 forward equals TP=1 ---------------------------------------------------


def _build_llama_variant(
    path: Path, num_heads: int, num_kv_heads: int, vocab: int, family: str = "Llama"
) -> str:
    """Llama (or OLMo 2: `family` "Olmo2") whose kv heads do not split evenly, over a
    vocabulary that is no multiple of the ranks' 64-row shares (the padding rows and the
    embedding's range masks)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        hidden_size=16 * num_heads,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        vocab_size=vocab,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    getattr(transformers, f"{family}ForCausalLM")(config).eval().save_pretrained(path)
    return str(path)


def checkpoint_dirs(gpt2: str, llama: str, qwen2: str, tiny_family_dir, tmp_path_factory) -> dict:
    """Every family's tiny checkpoint, and Llamas with 1 and 3 kv heads over 2 ranks."""
    dirs = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2}
    dirs |= {kind: tiny_family_dir(kind) for kind in SHARDED_FAMILIES}
    dirs["llama_kv1"] = _build_llama_variant(tmp_path_factory.mktemp("kv1"), 4, 1, 509)
    dirs["llama_kv3"] = _build_llama_variant(tmp_path_factory.mktemp("kv3"), 6, 3, 509)
    # OLMo 2's whole-width k norm over kv heads both ranks hold copies of ([0, 0, 1], [1, 2, 2]).
    olmo_kv3 = tmp_path_factory.mktemp("olmo_kv3")
    dirs["olmo2_kv3"] = _build_llama_variant(olmo_kv3, 6, 3, 509, family="Olmo2")
    return dirs


@pytest.fixture(scope="module")
def checkpoints(tiny_gpt2_dir, tiny_llama_dir, tiny_qwen2_dir, tiny_family_dir, tmp_path_factory):
    return checkpoint_dirs(
        tiny_gpt2_dir, tiny_llama_dir, tiny_qwen2_dir, tiny_family_dir, tmp_path_factory
    )


@torch.inference_mode()
def prefill_and_decode(model) -> dict[str, torch.Tensor]:
    """Prefill PROMPT_IDS in one step, then decode DECODE_IDS in one step, through the
    paged KV cache: each step's last-token logits, and the cache's kv heads per layer.
    On CUDA, the decode step replayed from a CUDA graph too (its collectives captured)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    lens = [len(p) for p in PROMPT_IDS]
    per_seq = max(lens) // BLOCK_SIZE + 2
    block_table = torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for layer in layers:
        shape = (block_table.numel(), BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.ops = AttentionOps.for_device(device)
    recurrent = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
    allocate_states(recurrent, len(lens), dtype, device)  # a sequence's state at its index

    def step(ids, positions, seqs, query_lens, seq_lens, is_decode):
        slots = [
            int(block_table[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for s, p in zip(seqs, positions, strict=True)
        ]
        starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            block_table=block_table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=starts.to(device),
            max_query_len=max(query_lens),
            is_decode=is_decode,
            state_slots=torch.arange(len(query_lens), device=device),
        )
        if recurrent and not is_decode:
            meta.spans = SequenceSpans.of(meta)
        ids, positions = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
        last = starts[1:].long().to(device) - 1
        return lambda: model.compute_logits(model(ids, positions, meta)[last])

    seqs = [s for s, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    prefill = step(sum(PROMPT_IDS, []), positions, seqs, lens, lens, False)
    n = len(lens)
    decode = step(DECODE_IDS, lens, list(range(n)), [1] * n, [x + 1 for x in lens], True)
    out = {"prefill": prefill().float().cpu(), "decode": decode().float().cpu()}
    out["kv_heads"] = torch.tensor([layer.num_kv_heads for layer in layers])
    if device.type == "cuda":  # the decode stores the same K/V again: replays repeat it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode()
        graph.replay()
        out["decode_graph"] = logits.float().cpu()
    return out


def tp_worker(
    rank: int, size: int, port: int, backend: str, dirs: dict[str, str], dtype, out: str
) -> None:
    """One rank: load every checkpoint's shard, run it, save what it computed."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        results = {
            kind: prefill_and_decode(load_model(path, device, dtype, tp=tp)[0])
            for kind, path in dirs.items()
        }
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(dirs: dict[str, str], out: Path, backend: str, dtype) -> list[dict]:
    """Every checkpoint at TP=2 in one spawned 2-process group: each rank's results."""
    mp.spawn(tp_worker, args=(2, free_port(), backend, dirs, dtype, str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory) -> list[dict]:
    return run_tensor_parallel(checkpoints, tmp_path_factory.mktemp("tp2"), "gloo", torch.float32)


KINDS = ["gpt2", "llama", "llama_kv1", "llama_kv3", "olmo2_kv3", "qwen2", *SHARDED_FAMILIES]
KV_HEADS_PER_RANK = {
    "llama": 1,
    "llama_kv1": 1,
    "llama_kv3": 3,
    "olmo2_kv3": 3,
    "gpt2": 2,
    "qwen3": 1,
}


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_logits_equal_tp1(kind, checkpoints, tp2):
    model, _ = load_model(checkpoints[kind], torch.device("cpu"), torch.float32)
    want = prefill_and_decode(model)
    got = tp2[0][kind]
    for step in ("prefill", "decode"):
        assert got[step].shape == want[step].shape
        torch.testing.assert_close(got[step], want[step], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[step].argmax(-1), want[step].argmax(-1))
        assert torch.equal(tp2[1][kind][step], got[step])  # rank 1 got the same (ignored)
    if kind in KV_HEADS_PER_RANK:  # each rank's cache holds its own kv heads
        for rank in range(2):
            assert (tp2[rank][kind]["kv_heads"] == KV_HEADS_PER_RANK[kind]).all()

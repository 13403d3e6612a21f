"""Encoders (BERT, XLM-RoBERTa, DistilBERT, ModernBERT): embeddings and classifier logits
equal transformers' on tiny random checkpoints, prompts of many lengths batched together."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.classification import class_probabilities
from engine.pooling import projector
from server.engine_wire import EngineInfo
from tests.reference import PROMPTS
from tests.tiny_checkpoints import FAMILY_CONFIGS, TINY

TEXTS = [*PROMPTS, "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]


def hf_states(model_dir: str, texts: list[str], pairs: list[str] | None = None):
    """transformers' (token ids, last hidden states or logits) per text, fp32, one at a
    time (no padding)."""
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    tok = AutoTokenizer.from_pretrained(model_dir)
    archs = AutoConfig.from_pretrained(model_dir).architectures
    classifier = archs[0].endswith("ForSequenceClassification")
    auto = AutoModelForSequenceClassification if classifier else AutoModel
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for i, text in enumerate(texts):
        enc = tok(text, pairs[i] if pairs else None, return_tensors="pt")
        with torch.no_grad():
            result = model(**enc)
        states = result.logits[0] if classifier else result.last_hidden_state[0]
        out.append((enc, states))
    return out


@pytest.mark.parametrize(
    ("kind", "pooling"),
    [
        ("bert_mean", "MEAN"),
        ("bert_cls", "CLS"),
        ("xlm_roberta", "CLS"),
        ("distilbert", "MEAN"),
        ("modernbert", "CLS"),
    ],
)
def test_encoder_embeddings_equal_transformers(tiny_encoder_dir, kind, pooling):
    model_dir = tiny_encoder_dir(kind)
    # A budget of one long prompt: the others wait whole, never chunked.
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=8)
    assert llm.engine.config.pooling_type == pooling
    assert llm.engine.config.max_num_batched_tokens == 128
    assert not llm.engine.config.enable_prefix_caching
    got = llm.embed(TEXTS, use_tqdm=False)
    for vector, (_, states) in zip(got, hf_states(model_dir, TEXTS), strict=True):
        pooled = states.mean(0) if pooling == "MEAN" else states[0]
        want = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        np.testing.assert_allclose(vector, want, atol=1e-5)


def test_encoder_prompts_share_steps_and_wait_whole(tiny_encoder_dir):
    """Several prompts in one step attend only within themselves; a prompt that does
    not fit the step's room waits for the next step instead of being chunked."""
    model_dir = tiny_encoder_dir("bert_mean")
    llm = LLM(model_dir, device="cpu", block_size=4, max_model_len=48, max_num_batched_tokens=48)
    engine = llm.engine
    texts = [TEXTS[-1], TEXTS[1], TEXTS[3], TEXTS[-1]]
    ids = [llm.tokenizer.encode(t)[:40] for t in texts]
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=True, detokenize=False)
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, params)
    steps: list[list[int]] = []
    execute = engine.runner.execute

    def recorded(out):
        steps.append(out.num_new_tokens.tolist())
        return execute(out)

    engine.runner.execute = recorded
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.embedding
    lengths = [len(p) for p in ids]
    assert lengths[0] == lengths[3] == 40 and lengths[1] + lengths[2] <= 48
    assert [s for s in steps if s] == [[40], lengths[1:3], [40]]
    model = hf_model(model_dir)
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            states = model(torch.tensor([prompt])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(states.mean(0), dim=-1).numpy()
        np.testing.assert_allclose(finished[str(i)], expected, atol=1e-5)


def hf_model(model_dir: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "kind",
    ["bert_classifier", "xlm_roberta_reranker", "distilbert_classifier", "modernbert_classifier"],
)
def test_encoder_classifiers_equal_transformers(tiny_encoder_dir, kind):
    model_dir = tiny_encoder_dir(kind)
    llm = LLM(model_dir, device="cpu", block_size=4)
    assert llm.engine.config.max_num_batched_tokens == 32768  # an encoder's default
    got = llm.classify(TEXTS, use_tqdm=False)
    logits = torch.stack([s for _, s in hf_states(model_dir, TEXTS)]).double().numpy()
    np.testing.assert_allclose(got, class_probabilities(logits), atol=1e-5)
    assert len(llm.engine.labels) == logits.shape[1]
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.embed(["x"], use_tqdm=False)


def test_encoder_generates_nothing(tiny_encoder_dir):
    llm = LLM(tiny_encoder_dir("bert_cls"), device="cpu", max_num_batched_tokens=2048)
    assert llm.engine.config.max_num_batched_tokens == 2048  # a budget given is kept
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="no speculative decoding"):
        LLM(tiny_encoder_dir("bert_cls"), device="cpu", num_speculative_tokens=2)


def _with_dense_modules(
    model_dir: str, path, second_activation: str, pooling: str = "pooling_mode_cls_token"
) -> list[torch.nn.Linear]:
    """A copy of model_dir as a sentence-transformers directory (LaBSE's layout): CLS
    pooling (or `pooling`), a tanh Dense 64 -> 48 (safetensors), a second Dense 48 -> 32
    without bias (a torch .bin), Normalize. Returns the two linear layers."""
    shutil.copytree(model_dir, path)
    torch.manual_seed(1)
    first, second = torch.nn.Linear(64, 48), torch.nn.Linear(48, 32, bias=False)
    modules = [
        ("", "Transformer", None),
        ("1_Pooling", "Pooling", {pooling: True}),
        ("2_Dense", "Dense", {"in_features": 64, "out_features": 48, "bias": True}),
        ("3_Dense", "Dense", {"in_features": 48, "out_features": 32, "bias": False}),
        ("4_Normalize", "Normalize", None),
    ]
    modules[2][2]["activation_function"] = "torch.nn.modules.activation.Tanh"
    modules[3][2]["activation_function"] = second_activation
    entries = []
    for i, (folder, kind, settings) in enumerate(modules):
        entries.append({"idx": i, "name": str(i), "path": folder, "type": f"st.models.{kind}"})
        if folder:
            (path / folder).mkdir()
        if settings is not None:
            (path / folder / "config.json").write_text(json.dumps(settings))
    save_file({f"linear.{k}": v for k, v in first.state_dict().items()},
              path / "2_Dense" / "model.safetensors")  # fmt: skip
    torch.save({"linear.weight": second.weight.detach()}, path / "3_Dense" / "pytorch_model.bin")
    (path / "modules.json").write_text(json.dumps(entries))
    return [first, second]


def test_sentence_transformers_dense_modules_apply(tiny_encoder_dir, tmp_path, caplog):
    model_dir = tiny_encoder_dir("bert_cls")
    identity = "torch.nn.modules.linear.Identity"
    first, second = _with_dense_modules(model_dir, tmp_path / "st", identity)
    llm = LLM(str(tmp_path / "st"), device="cpu", block_size=4)
    assert EngineInfo.of(llm.engine).hidden_size == 32  # /v1/embeddings' dimensions bound
    got = llm.embed(TEXTS, use_tqdm=False)
    with torch.no_grad():
        for vector, (_, states) in zip(got, hf_states(model_dir, TEXTS), strict=True):
            want = torch.nn.functional.normalize(second(torch.tanh(first(states[0]))), dim=-1)
            np.testing.assert_allclose(vector, want.numpy(), atol=1e-5)
    # A module Pagoda does not apply is named in the log.
    entries = json.loads((tmp_path / "st" / "modules.json").read_text())
    entries.insert(4, {"idx": 9, "name": "9", "path": "", "type": "st.models.LayerNorm"})
    (tmp_path / "st" / "modules.json").write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING, logger="pagoda.engine"):
        assert projector(str(tmp_path / "st")) is not None
    assert "module LayerNorm is not applied" in caplog.text
    # An activation Pagoda does not know is refused, not skipped.
    _with_dense_modules(model_dir, tmp_path / "bad", "torch.nn.modules.activation.SiLU")
    with pytest.raises(ValueError, match="Dense activation .*SiLU"):
        LLM(str(tmp_path / "bad"), device="cpu")


def test_embedding_gemma_attends_both_ways(tokenizer, tmp_path):
    """EmbeddingGemma's layout: a bare Gemma 3 with use_bidirectional_attention (its
    sliding layers see |q - k| < sliding_window either way), mean pooling, Dense
    modules; the longest text crosses the window of 8 several times."""
    import transformers

    _, _, fields = FAMILY_CONFIGS["gemma3"]
    config = transformers.Gemma3TextConfig(
        **TINY, **fields, vocab_size=len(tokenizer), use_bidirectional_attention=True
    )
    torch.manual_seed(0)
    transformers.Gemma3TextModel(config).save_pretrained(tmp_path / "bare")
    tokenizer.save_pretrained(tmp_path / "bare")
    identity = "torch.nn.modules.linear.Identity"
    first, second = _with_dense_modules(
        str(tmp_path / "bare"), tmp_path / "st", identity, "pooling_mode_mean_tokens"
    )
    llm = LLM(str(tmp_path / "st"), device="cpu", block_size=4)
    assert llm.engine.config.encoder and llm.engine.config.pooling_type == "MEAN"
    got = llm.embed(TEXTS, use_tqdm=False)
    with torch.no_grad():
        for vector, (_, states) in zip(got, hf_states(str(tmp_path / "bare"), TEXTS), strict=True):
            want = second(torch.tanh(first(states.mean(0))))
            np.testing.assert_allclose(vector, F.normalize(want, dim=-1).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)

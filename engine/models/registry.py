"""Which class serves each Hugging Face `model_type` (config.json's)."""

from __future__ import annotations

from torch import nn

from engine.models.afmoe import AfmoeForCausalLM
from engine.models.arcee import ApertusForCausalLM, ArceeForCausalLM
from engine.models.bamba import BambaForCausalLM
from engine.models.bert import BertModel
from engine.models.cohere import Cohere2ForCausalLM, Cohere2MoeForCausalLM, CohereForCausalLM
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.ernie4_5 import Ernie4_5ForCausalLM, Ernie4_5MoeForCausalLM
from engine.models.exaone4 import Exaone4ForCausalLM, ExaoneMoeForCausalLM
from engine.models.falcon import FalconForCausalLM
from engine.models.falcon_h1 import FalconH1ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM, GemmaForCausalLM
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from engine.models.glm4_moe import Dots1ForCausalLM, Glm4MoeForCausalLM
from engine.models.gpt2 import GPT2ForCausalLM, GPTBigCodeForCausalLM
from engine.models.gpt_neox import (
    GPTJForCausalLM,
    GPTNeoXForCausalLM,
    PhiForCausalLM,
    Starcoder2ForCausalLM,
)
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM, GraniteSWAForCausalLM
from engine.models.granite_hybrid import GraniteMoeHybridForCausalLM
from engine.models.granite_moe import (
    GraniteMoeForCausalLM,
    GraniteMoeSharedForCausalLM,
    GraniteMoeSWAForCausalLM,
)
from engine.models.helium import HeliumForCausalLM
from engine.models.hunyuan import HunyuanForCausalLM, HunyuanMoeForCausalLM
from engine.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llama4 import Llama4ForCausalLM
from engine.models.mimo_v2 import MiMoV2FlashForCausalLM
from engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from engine.models.modernbert import ModernBertModel
from engine.models.moe import MoeForCausalLM
from engine.models.nemotron import Jais2ForCausalLM, NemotronForCausalLM
from engine.models.nemotron_h import Mamba2ForCausalLM, NemotronHForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM, OlmoeForCausalLM, OlmoForCausalLM
from engine.models.opt import OPTForCausalLM
from engine.models.phimoe import PhimoeForCausalLM
from engine.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from engine.models.stablelm import StableLmForCausalLM

# Each is built as MODEL_TYPES[model_type](config, tp): the rank's shard of the model.
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "gpt2": GPT2ForCausalLM,
    "gpt_bigcode": GPTBigCodeForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen2_vl_text": LlamaForCausalLM,  # the VL models' language models (TEXT_OF_MULTIMODAL)
    "qwen2_5_vl_text": LlamaForCausalLM,
    "qwen3_vl_text": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "ministral": LlamaForCausalLM,  # Ministral 8B: Mistral with layer_types' windows
    "phi3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "arcee": ArceeForCausalLM,
    "apertus": ApertusForCausalLM,
    "afmoe": AfmoeForCausalLM,
    "helium": HeliumForCausalLM,
    "stablelm": StableLmForCausalLM,
    "hunyuan_v1_dense": HunyuanForCausalLM,
    "hunyuan_v1_moe": HunyuanMoeForCausalLM,
    "nemotron": NemotronForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "mamba2": Mamba2ForCausalLM,
    "jais2": Jais2ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,  # and qwen3_5's language model (TEXT_OF_MULTIMODAL)
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "qwen3_vl_moe_text": MoeForCausalLM,
    "qwen2_moe": MoeForCausalLM,
    "phimoe": PhimoeForCausalLM,
    "mixtral": MoeForCausalLM,
    "llama4_text": Llama4ForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "mimo_v2_flash": MiMoV2FlashForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": Gemma3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma4_text": Gemma4ForCausalLM,
    "granite": GraniteForCausalLM,
    "granitemoe": GraniteMoeForCausalLM,
    "granitemoeshared": GraniteMoeSharedForCausalLM,
    "granite_swa": GraniteSWAForCausalLM,
    "granitemoe_swa": GraniteMoeSWAForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "bamba": BambaForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "gpt_neox": GPTNeoXForCausalLM,
    "phi": PhiForCausalLM,
    "gptj": GPTJForCausalLM,
    "opt": OPTForCausalLM,
    "falcon": FalconForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "cohere": CohereForCausalLM,
    "cohere2": Cohere2ForCausalLM,
    "cohere2_moe": Cohere2MoeForCausalLM,
    "glm": GlmForCausalLM,
    "glm4": Glm4ForCausalLM,
    "ernie4_5": Ernie4_5ForCausalLM,
    "ernie4_5_moe": Ernie4_5MoeForCausalLM,
    "exaone4": Exaone4ForCausalLM,
    "exaone_moe": ExaoneMoeForCausalLM,
    "seed_oss": LlamaForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "dots1": Dots1ForCausalLM,
    "solar_open": Glm4MoeForCausalLM,  # Solar Open: GLM-4.5's layers, every one MoE
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "glm4_moe_lite": DeepseekForCausalLM,  # GLM-4.7-Flash: DeepSeek-V3's layers
    "mistral4": DeepseekForCausalLM,  # DeepSeek-V3's layers, softmax routing, a q scale
    "olmo": OlmoForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "olmo3": Olmo2ForCausalLM,
    "olmoe": OlmoeForCausalLM,
    # Encoders (engine/models/bert.py's ENCODER_TYPES): embeddings and scores only.
    "bert": BertModel,
    "roberta": BertModel,
    "xlm-roberta": BertModel,
    "distilbert": BertModel,
    "modernbert": ModernBertModel,
}

"""The architectures crane-mp serves: one row each, the only table a new architecture is added to.

Torch-free and importing nothing of crane_mp (the launcher reads it): names, tensor-name maps and config rules only.
crane_mp/worker/models/build.py turns a row's `model_class` into the model; config.py and gguf_file.py read
the rest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One served architecture: how checkpoints and GGUF files name it, and the rules that differ by it."""

    name: str  # ours: ModelConfig.arch, a --model-type choice
    model_class: str  # "module.Class" under crane_mp.worker.models, or "package.module.Class" (register_model)
    hf_classes: tuple[str, ...]  # config.json "architectures" entries served as this architecture
    hf_model_type: str  # transformers' model_type (config.json "model_type")
    gguf_arch: str  # general.architecture llama.cpp's converter writes for it
    # Files whose general.architecture is gguf_arch are served as this row (False where llama.cpp
    # files the architecture under another row's name, as it does Mistral before v3 under "llama").
    reads_gguf: bool = True
    # llama.cpp's converter permutes the q/k rows of this GGUF architecture for its interleaved rope.
    gguf_permuted_qk: bool = False
    # Per-head query/key RMSNorm modules under a layer (Hugging Face names), or None. Where the norm
    # sits (before or after rope) is the model class's `qk_norm_position`.
    qk_norms: tuple[str, str] | None = None
    # transformers windows only the layers from max_window_layers on (layer_types lists them), and
    # only when use_sliding_window is set; otherwise `sliding_window` applies to every layer.
    window_by_layer: bool = False
    model_type_aliases: tuple[str, ...] = ()  # further --model-type spellings (crane-oai's)
    # An encoder (BERT family): every prompt attends to all of itself, so it runs whole in one step,
    # keeps no KV cache and serves pooling only (--task embed / score).
    encoder: bool = False
    # What a request may bring besides text: "image" (a vision-language model's image parts) or "audio"
    # (a speech model's window, served by /v1/audio/transcriptions only).
    media: str | None = None
    # A vision-language row: the row of its language model (text_config), and its multimodal rope
    # ("sections" in three runs, "interleaved"; None: one position per token).
    text_arch: str | None = None
    mrope: str | None = None
    # Activations overflow float16 (Gemma's residual stream): where auto would pick float16, float32 runs.
    overflows_float16: bool = False
    # Split over ranks by --tensor-parallel-size (sharding.py); the 2026 families are not validated
    # there yet (fused checkpoint tensors, OLMo's whole-width q/k norms) and run on one device.
    tensor_parallel: bool = True
    # Per-layer GGUF tensor names -> Hugging Face module names where the family's differ from
    # GGUF_LAYER_NAMES (the whole map then; its q/k norms come from `qk_norms`).
    gguf_layer_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0  # llama.cpp's converter stores Gemma's norm weights as 1 + w
    full_width_qk_norms: bool = False  # q/k norms over all heads at once (OLMo 2): their GGUF shapes
    # Per-layer GGUF tensors some layers lack (Gemma 4: no keys or values where a layer reads another's).
    gguf_optional_layer_names: tuple[str, ...] = ()
    # Its MLPs are mixtures of experts (where, the layout says): GGUF files hold GGUF_EXPERT_NAMES' tensors.
    experts: bool = False
    # llama.cpp files it under gguf_arch as another row's files, told apart by a sigmoid router (DeepSeek-V3).
    gguf_sigmoid_router: bool = False


TRANSFORMERS = "transformers"  # the transformers backend's row

# The projections' GGUF names, and each block kind's norms (llama.cpp's names for the 2026 families).
_PROJECTIONS = (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                ("ffn_down", "mlp.down_proj"))
_SANDWICH_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                  ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
                  *_PROJECTIONS)
_POST_GGUF = (("post_attention_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
              *_PROJECTIONS)
# Gemma 4's per-layer input gate, projection and norm, and each layer's output scalar.
_GEMMA4_GGUF = (*_SANDWICH_GGUF, ("inp_gate", "per_layer_input_gate"), ("proj", "per_layer_projection"),
                ("post_norm", "post_per_layer_input_norm"), ("layer_output_scale", "layer_scalar"))
_SEED_OSS_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"), *_PROJECTIONS)
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# GLM-4's four norms, and its gate/up kept fused.
_GLM4_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_self_attn_layernorm"),
              ("ffn_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_mlp_layernorm"),
              *_PROJECTIONS[:4], ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj"))
# gpt-oss: a norm before attention and one after, the attention sinks; its MLPs are experts alone.
_GPT_OSS_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                 *_PROJECTIONS[:4], ("attn_sinks", "self_attn.sinks"))
# GLM-4.5: Llama's layer with its post-attention norm under llama.cpp's other name.
_GLM4_MOE_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                  *_PROJECTIONS)
# DeepSeek's latent attention as llama.cpp's converter splits kv_b_proj (per-head key and value parts),
# its query projection one matrix (V2-Lite) or a low-rank pair (the rest).
_DEEPSEEK_QUERY = ("attn_q", "attn_q_a", "attn_q_a_norm", "attn_q_b")
_DEEPSEEK_GGUF = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                  *zip(_DEEPSEEK_QUERY, ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
                                         "self_attn.q_b_proj")),
                  ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"), ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
                  ("attn_k_b", "self_attn.k_b_proj"), ("attn_v_b", "self_attn.v_b_proj"),
                  ("attn_output", "self_attn.o_proj"), *_PROJECTIONS[4:])
# Qwen3.5's layers: gated attention (attn_q: each head's query and gate) or a Gated DeltaNet (ssm_a is
# -exp(A_log)), then a dense MLP (the last three; the MoE files' experts are GGUF_EXPERT_NAMES').
_LINEAR_ATTENTION_GGUF = (("attn_qkv", "linear_attn.in_proj_qkv"), ("attn_gate", "linear_attn.in_proj_z"),
                          ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_a", "linear_attn.A_log"),
                          ("ssm_dt", "linear_attn.dt_bias"), ("ssm_norm", "linear_attn.norm"),
                          ("ssm_out", "linear_attn.out_proj"))
_QWEN35_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                *_PROJECTIONS[:4], *_LINEAR_ATTENTION_GGUF, ("ssm_beta", "linear_attn.in_proj_b"),
                ("ssm_alpha", "linear_attn.in_proj_a"), *_PROJECTIONS[4:])
# Qwen3-Next: b and a in one tensor, grouped by key head as its checkpoint has them.
_QWEN3_NEXT_GGUF = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                    *_PROJECTIONS[:4], *_LINEAR_ATTENTION_GGUF, ("ssm_ba", "linear_attn.in_proj_ba"),
                    *_PROJECTIONS[4:])
# Each layer holds one kind's: attention's or the linear attention's.
_HYBRID_LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_conv1d", "ssm_a",
                       "ssm_dt", "ssm_norm", "ssm_out", "ssm_beta", "ssm_alpha", "ssm_ba")
# Cohere's parallel block has one norm.
_PARALLEL_GGUF = (("attn_norm", "input_layernorm"), *_PROJECTIONS)
# Phi-3's files keep its fused projections fused, as its checkpoints do.
_PHI3_GGUF = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
              ("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_up", "mlp.gate_up_proj"),
              ("ffn_down", "mlp.down_proj"))

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (
    Architecture("llama", "llama.LlamaForCausalLM", ("LlamaForCausalLM",), "llama", "llama",
                 gguf_permuted_qk=True),
    Architecture("mistral", "llama.LlamaForCausalLM", ("MistralForCausalLM",), "mistral", "llama",
                 reads_gguf=False, gguf_permuted_qk=True),
    Architecture("qwen2", "qwen2.Qwen2ForCausalLM", ("Qwen2ForCausalLM",), "qwen2", "qwen2",
                 window_by_layer=True, model_type_aliases=("qwen25",)),
    Architecture("qwen3", "qwen3.Qwen3ForCausalLM", ("Qwen3ForCausalLM",), "qwen3", "qwen3",
                 qk_norms=("self_attn.q_norm", "self_attn.k_norm"), window_by_layer=True),
    Architecture("hunyuan", "hunyuan.HunYuanDenseForCausalLM", ("HunYuanDenseV1ForCausalLM",), "hunyuan_v1_dense",
                 "hunyuan-dense", qk_norms=("self_attn.query_layernorm", "self_attn.key_layernorm")),
    Architecture("qwen2_5_vl", "qwen2_5_vl.Qwen25VLForConditionalGeneration", ("Qwen2_5_VLForConditionalGeneration",),
                 "qwen2_5_vl", "qwen2vl", reads_gguf=False, window_by_layer=True, media="image", text_arch="qwen2",
                 mrope="sections"),
    Architecture("qwen3_vl", "qwen3_vl.Qwen3VLForConditionalGeneration", ("Qwen3VLForConditionalGeneration",),
                 "qwen3_vl", "qwen3vl", reads_gguf=False, qk_norms=_QK_NORMS, tensor_parallel=False, media="image",
                 text_arch="qwen3", mrope="interleaved"),
    Architecture("qwen3_vl_moe", "qwen3_vl.Qwen3VLForConditionalGeneration", ("Qwen3VLMoeForConditionalGeneration",),
                 "qwen3_vl_moe", "qwen3vlmoe", reads_gguf=False, qk_norms=_QK_NORMS, tensor_parallel=False,
                 experts=True, media="image", text_arch="qwen3_moe", mrope="interleaved"),
    Architecture("whisper", "whisper.WhisperForConditionalGeneration", ("WhisperForConditionalGeneration",),
                 "whisper", "whisper", reads_gguf=False, media="audio"),
    Architecture("bert", "bert.BertEncoder", ("BertModel", "BertForSequenceClassification"), "bert", "bert",
                 reads_gguf=False, encoder=True),
    Architecture("roberta", "bert.BertEncoder", ("RobertaModel", "RobertaForSequenceClassification"), "roberta",
                 "roberta", reads_gguf=False, encoder=True),
    Architecture("xlm-roberta", "bert.BertEncoder", ("XLMRobertaModel", "XLMRobertaForSequenceClassification"),
                 "xlm-roberta", "xlm-roberta", reads_gguf=False, encoder=True),
    # The 2026 dense families (DecoderLayout says how each departs from Llama's layer), GGUF files as
    # llama.cpp's converter writes them.
    Architecture("gemma2", "gemma.Gemma2ForCausalLM", ("Gemma2ForCausalLM",), "gemma2", "gemma2",
                 overflows_float16=True, tensor_parallel=False, gguf_layer_names=_SANDWICH_GGUF, gguf_norm_offset=1.0),
    Architecture("gemma3", "gemma.Gemma3ForCausalLM", ("Gemma3ForCausalLM",),
                 "gemma3_text", "gemma3", qk_norms=_QK_NORMS, overflows_float16=True, tensor_parallel=False,
                 gguf_layer_names=_SANDWICH_GGUF, gguf_norm_offset=1.0),
    # Gemma 3's vision-language checkpoints (4B and up): its SigLIP tower, images attended both ways.
    Architecture("gemma3_vl", "gemma3_vl.Gemma3VLForConditionalGeneration", ("Gemma3ForConditionalGeneration",),
                 "gemma3", "gemma3", reads_gguf=False, qk_norms=_QK_NORMS, overflows_float16=True,
                 tensor_parallel=False, media="image", text_arch="gemma3"),
    # Gemma 4 (text; its mixture-of-experts variant runs through the transformers backend).
    Architecture("gemma4", "gemma4.Gemma4ForCausalLM", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
                 "gemma4_text", "gemma4", qk_norms=_QK_NORMS, overflows_float16=True, tensor_parallel=False,
                 gguf_layer_names=_GEMMA4_GGUF, gguf_optional_layer_names=("attn_k", "attn_v", "inp_gate", "proj",
                                                                          "post_norm")),
    Architecture("phi3", "llama.LlamaForCausalLM", ("Phi3ForCausalLM",), "phi3", "phi3", tensor_parallel=False,
                 gguf_layer_names=_PHI3_GGUF),
    Architecture("olmo2", "olmo.Olmo2ForCausalLM", ("Olmo2ForCausalLM",), "olmo2", "olmo2", qk_norms=_QK_NORMS,
                 tensor_parallel=False, gguf_layer_names=_POST_GGUF, full_width_qk_norms=True),
    # llama.cpp files OLMo 3 as "olmo2" with its sliding pattern: read as the olmo2 row (the same class).
    Architecture("olmo3", "olmo.Olmo2ForCausalLM", ("Olmo3ForCausalLM",), "olmo3", "olmo2", reads_gguf=False,
                 qk_norms=_QK_NORMS, tensor_parallel=False, gguf_layer_names=_POST_GGUF, full_width_qk_norms=True),
    Architecture("smollm3", "llama.LlamaForCausalLM", ("SmolLM3ForCausalLM",), "smollm3", "smollm3",
                 gguf_permuted_qk=True, tensor_parallel=False),
    Architecture("granite", "llama.LlamaForCausalLM", ("GraniteForCausalLM",), "granite", "granite",
                 gguf_permuted_qk=True, tensor_parallel=False),
    # Granite 4 dense: the hybrid family's checkpoint with attention in every layer and no experts.
    Architecture("granite4", "granite.Granite4ForCausalLM", ("GraniteMoeHybridForCausalLM",), "granitemoehybrid",
                 "granitehybrid", tensor_parallel=False),
    Architecture("glm4", "glm4.Glm4ForCausalLM", ("Glm4ForCausalLM",), "glm4", "glm4", tensor_parallel=False,
                 gguf_layer_names=_GLM4_GGUF),
    Architecture("cohere2", "llama.LlamaForCausalLM", ("Cohere2ForCausalLM",), "cohere2", "cohere2",
                 tensor_parallel=False, gguf_layer_names=_PARALLEL_GGUF),
    Architecture("exaone4", "qwen3.Qwen3ForCausalLM", ("Exaone4ForCausalLM",), "exaone4", "exaone4",
                 qk_norms=_QK_NORMS, tensor_parallel=False, gguf_layer_names=_POST_GGUF),
    Architecture("seed_oss", "llama.LlamaForCausalLM", ("SeedOssForCausalLM",), "seed_oss", "seed_oss",
                 tensor_parallel=False, gguf_layer_names=_SEED_OSS_GGUF),
    # Mixtures of experts (the layout's ExpertLayout, worker/models/moe.py). llama.cpp files Mixtral
    # under "llama" (gguf_row tells its files apart by their experts).
    Architecture("qwen2_moe", "llama.LlamaForCausalLM", ("Qwen2MoeForCausalLM",), "qwen2_moe", "qwen2moe",
                 window_by_layer=True, tensor_parallel=False, experts=True),
    Architecture("qwen3_moe", "qwen3.Qwen3ForCausalLM", ("Qwen3MoeForCausalLM",), "qwen3_moe", "qwen3moe",
                 qk_norms=_QK_NORMS, window_by_layer=True, tensor_parallel=False, experts=True),
    Architecture("mixtral", "mixtral.MixtralForCausalLM", ("MixtralForCausalLM",), "mixtral", "llama", reads_gguf=False,
                 gguf_permuted_qk=True, tensor_parallel=False, experts=True),
    Architecture("olmoe", "olmo.Olmo2ForCausalLM", ("OlmoeForCausalLM",), "olmoe", "olmoe", qk_norms=_QK_NORMS,
                 tensor_parallel=False, full_width_qk_norms=True, experts=True),
    Architecture("granitemoe", "granite.GraniteMoeForCausalLM", ("GraniteMoeForCausalLM",), "granitemoe", "granitemoe",
                 gguf_permuted_qk=True, tensor_parallel=False, experts=True),
    Architecture("gpt_oss", "gpt_oss.GptOssForCausalLM", ("GptOssForCausalLM",), "gpt_oss", "gpt-oss",
                 tensor_parallel=False, gguf_layer_names=_GPT_OSS_GGUF, experts=True),
    Architecture("glm4_moe", "glm4.Glm4MoeForCausalLM", ("Glm4MoeForCausalLM",), "glm4_moe", "glm4moe",
                 tensor_parallel=False, gguf_layer_names=_GLM4_MOE_GGUF, experts=True),
    # DeepSeek's latent attention and routers (worker/models/deepseek.py); its GGUF files are not read yet.
    Architecture("deepseek_v2", "deepseek.DeepseekForCausalLM", ("DeepseekV2ForCausalLM",), "deepseek_v2", "deepseek2",
                 tensor_parallel=False, gguf_layer_names=_DEEPSEEK_GGUF, gguf_optional_layer_names=_DEEPSEEK_QUERY,
                 experts=True),
    Architecture("deepseek_v3", "deepseek.DeepseekForCausalLM", ("DeepseekV3ForCausalLM",), "deepseek_v3", "deepseek2",
                 reads_gguf=False, tensor_parallel=False, gguf_layer_names=_DEEPSEEK_GGUF,
                 gguf_optional_layer_names=_DEEPSEEK_QUERY, experts=True, gguf_sigmoid_router=True),
    # Hybrids: Gated DeltaNet layers (recurrent state, worker/cache/state_pool.py) between gated attention
    # layers. A layer of a GGUF file holds one kind's tensors; llama.cpp's converter stores the (1 + w)
    # norms as 1 + w.
    Architecture("qwen3_5", "qwen3_5.Qwen35ForCausalLM", ("Qwen3_5ForCausalLM",),
                 "qwen3_5_text", "qwen35", qk_norms=_QK_NORMS, tensor_parallel=False, gguf_layer_names=_QWEN35_GGUF,
                 gguf_optional_layer_names=_HYBRID_LAYER_PARTS, gguf_norm_offset=1.0),
    Architecture("qwen3_5_moe", "qwen3_5.Qwen35ForCausalLM", ("Qwen3_5MoeForCausalLM",), "qwen3_5_moe_text",
                 "qwen35moe", qk_norms=_QK_NORMS, tensor_parallel=False, experts=True, gguf_layer_names=_QWEN35_GGUF,
                 gguf_optional_layer_names=_HYBRID_LAYER_PARTS, gguf_norm_offset=1.0),
    # Their vision-language checkpoints: the same language models, Qwen3-VL's tower without deepstack.
    Architecture("qwen3_5_vl", "qwen3_vl.Qwen35VLForConditionalGeneration", ("Qwen3_5ForConditionalGeneration",),
                 "qwen3_5", "qwen35", reads_gguf=False, qk_norms=_QK_NORMS, tensor_parallel=False, media="image",
                 text_arch="qwen3_5", mrope="interleaved"),
    Architecture("qwen3_5_moe_vl", "qwen3_vl.Qwen35VLForConditionalGeneration",
                 ("Qwen3_5MoeForConditionalGeneration",), "qwen3_5_moe", "qwen35moe", reads_gguf=False,
                 qk_norms=_QK_NORMS, tensor_parallel=False, experts=True, media="image", text_arch="qwen3_5_moe",
                 mrope="interleaved"),
    Architecture("qwen3_next", "qwen3_5.Qwen3NextForCausalLM", ("Qwen3NextForCausalLM",), "qwen3_next", "qwen3next",
                 qk_norms=_QK_NORMS, tensor_parallel=False, experts=True, gguf_layer_names=_QWEN3_NEXT_GGUF,
                 gguf_optional_layer_names=_HYBRID_LAYER_PARTS, gguf_norm_offset=1.0),
    # Any other causal LM transformers can run, through its own modeling code (--model-impl).
    Architecture(TRANSFORMERS, "transformers_backend.TransformersCausalLM", (), "", "", reads_gguf=False),
)}

# Lookups, all derived from the rows (register_model adds to them).
HF_CLASSES: dict[str, str] = {}
# --model-type spellings: our names, transformers' model types, llama.cpp's architectures, aliases.
MODEL_TYPE_ALIASES: dict[str, str] = {}
GGUF_ARCHITECTURES: dict[str, Architecture] = {}
PERMUTED_QK_ARCHS: set[str] = set()


def _index(arch: Architecture) -> None:
    HF_CLASSES.update(dict.fromkeys(arch.hf_classes, arch.name))
    spellings = (arch.name, arch.hf_model_type, *((arch.gguf_arch,) if arch.reads_gguf else ()),
                 *arch.model_type_aliases)
    if arch.name != TRANSFORMERS:  # chosen by --model-impl, not spelled as a model type
        # Our names stay ours: transformers' qwen3_5 is the vision-language checkpoint, our qwen3_5 its text.
        MODEL_TYPE_ALIASES.update({spelling: arch.name for spelling in spellings
                                   if spelling == arch.name or spelling not in ARCHITECTURES})
    if arch.reads_gguf:
        GGUF_ARCHITECTURES[arch.gguf_arch] = arch
    if arch.gguf_permuted_qk:
        PERMUTED_QK_ARCHS.add(arch.gguf_arch)


for _arch in ARCHITECTURES.values():
    _index(_arch)


def register_model(arch: Architecture) -> None:
    """Serve another architecture (as vLLM's ModelRegistry.register_model): its `model_class` names the
    class in full ("package.module.Class"), imported only where the model is built. Every process
    reads the registry, so register from a module the `crane_mp.models` entry-point group names (a
    function called with no arguments when this module is first imported); a name already served is
    refused."""
    if arch.name in ARCHITECTURES or arch.name in MODEL_TYPE_ALIASES:
        raise ValueError(f"architecture {arch.name!r} is already served")
    taken = sorted(set(arch.hf_classes) & set(HF_CLASSES))
    if taken:
        raise ValueError(f"{', '.join(taken)} already served as {HF_CLASSES[taken[0]]!r}")
    ARCHITECTURES[arch.name] = arch
    _index(arch)
    if not arch.gguf_layer_names:
        _GGUF_LAYER_BY_HF.update(zip(arch.qk_norms or (), GGUF_QK_NORM_NAMES))


def load_plugins() -> None:
    """Call every function the installed packages name in the `crane_mp.models` entry-point group."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="crane_mp.models"):
        entry.load()()


# GGUF tensor names -> Hugging Face module names, the same for every architecture but the q/k norms
# (the GGUF loader reads files by these tables, testing/make_gguf.py writes them). Every layer of a
# GGUF file must hold the weights of GGUF_LAYER_NAMES (gguf_file.py checks).
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORM_NAMES = ("attn_q_norm", "attn_k_norm")
# A mixture-of-experts layer's tensors (rows `registry.experts`): its router, its experts stacked one
# tensor per projection ([experts, rows, columns]), a shared expert and its gate where the family has them.
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "exp_probs_b": "mlp.correction_bias",  # the sigmoid router's correction (DeepSeek-V3, GLM-4.5)
}
GGUF_SHARED_EXPERT_NAMES = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")
DENSE_MLP_NAMES = ("ffn_gate", "ffn_up", "ffn_down")
# Checkpoint tensors that are a layer's own buffer, not a module's weight (a file names them `.weight`).
BARE_LAYER_TENSORS = frozenset({"layer_scalar", "self_attn.sinks", "mlp.correction_bias", "linear_attn.A_log",
                                "linear_attn.dt_bias"})
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
                     # Gemma 4's per-layer input embeddings
                     "per_layer_token_embd": "model.embed_tokens_per_layer",
                     "per_layer_model_proj": "model.per_layer_model_projection",
                     "per_layer_proj_norm": "model.per_layer_projection_norm"}


def supported() -> str:
    """Our native architecture names, for error messages."""
    return ", ".join(sorted(set(ARCHITECTURES) - {TRANSFORMERS}))


def gguf_layer_names(arch: str) -> dict[str, str]:
    """Architecture `arch`'s (ours) per-layer GGUF names -> Hugging Face module names, q/k norms
    included where it has them; every layer of a file holds all but the q/k norms' (gguf_file.py)."""
    row = ARCHITECTURES[arch]
    names = dict(row.gguf_layer_names) or dict(GGUF_LAYER_NAMES)
    return names | dict(zip(GGUF_QK_NORM_NAMES, row.qk_norms or ())) | (GGUF_EXPERT_NAMES if row.experts else {})


def gguf_optional_names(row: Architecture) -> tuple[str, ...]:
    """Per-layer GGUF tensors a file of `row` may lack: its optional ones, and with experts the dense
    MLP's and the shared expert's (llama.cpp writes every layer of a MoE file with experts)."""
    if not row.experts:
        return row.gguf_optional_layer_names
    return (*row.gguf_optional_layer_names, *DENSE_MLP_NAMES, *GGUF_SHARED_EXPERT_NAMES, "exp_probs_b")


def gguf_row(gguf_arch: str, experts: bool, sigmoid_router: bool = False) -> Architecture:
    """The row serving GGUF files of `gguf_arch`, given whether the file holds experts and routes them by
    sigmoid: llama.cpp files Mixtral under "llama", told apart by its experts, and DeepSeek-V3 under
    "deepseek2", told apart by its router."""
    row = GGUF_ARCHITECTURES[gguf_arch]
    if experts and not row.experts:
        return next((other for other in ARCHITECTURES.values() if other.gguf_arch == gguf_arch and other.experts), row)
    if sigmoid_router and not row.gguf_sigmoid_router:
        return next((other for other in ARCHITECTURES.values()
                     if other.gguf_arch == gguf_arch and other.gguf_sigmoid_router), row)
    return row


def hf_name(gguf_name: str, arch: str) -> str:
    """A GGUF tensor name -> its Hugging Face checkpoint name under architecture `arch` (ours)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[stem]}.{kind}"
    if stem.count(".") == 1:  # a layer tensor without a kind (ssm_a)
        stem, kind = gguf_name, ""
    _, layer, short = stem.split(".")
    module = gguf_layer_names(arch)[short]
    return f"model.layers.{layer}.{module}" if module in BARE_LAYER_TENSORS else f"model.layers.{layer}.{module}.{kind}"


_GGUF_GLOBAL_BY_HF = {hf: short for short, hf in GGUF_GLOBAL_NAMES.items()}
_GGUF_LAYER_BY_HF = {hf: short for short, hf in (GGUF_LAYER_NAMES | GGUF_EXPERT_NAMES).items()} | {
    hf: short for arch in ARCHITECTURES.values() for hf, short in zip(arch.qk_norms or (), GGUF_QK_NORM_NAMES)
}


def gguf_name(hf_name: str, arch: str | None = None) -> str:
    """A Hugging Face checkpoint name -> its GGUF tensor name: hf_name's inverse, for architecture
    `arch` (ours), or with None for any that uses GGUF_LAYER_NAMES."""
    stem, _, kind = hf_name.rpartition(".")
    if any(hf_name.endswith(f".{bare}") for bare in BARE_LAYER_TENSORS):
        stem, kind = hf_name, "weight"
    if stem in _GGUF_GLOBAL_BY_HF:
        return f"{_GGUF_GLOBAL_BY_HF[stem]}.{kind}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"]:
        by_hf = _GGUF_LAYER_BY_HF if arch is None else {hf: short for short, hf in gguf_layer_names(arch).items()}
        return f"blk.{parts[2]}.{by_hf['.'.join(parts[3:])]}.{kind}"
    raise ValueError(f"no GGUF name for {hf_name}")


load_plugins()

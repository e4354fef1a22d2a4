"""models/registry.py is the one architecture table: every lookup (--model-type, config.json classes,
GGUF architectures and tensor names, the model class) comes from its rows; what reads it stays
torch-free (test_import_graph.py checks that no import circle is left)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.models.config import UnsupportedModelError, detect_arch, model_config_from_hf
from crane_mp.models.gguf_file import GGUFFileError, read_shape
from crane_mp.models.registry import (
    ARCHITECTURES,
    GGUF_ARCHITECTURES,
    HF_CLASSES,
    MODEL_TYPE_ALIASES,
    PERMUTED_QK_ARCHS,
    TRANSFORMERS,
    gguf_name,
    hf_name,
)
from crane_mp.testing.make_encoder import ARCHS as ENCODER_ARCHS
from crane_mp.testing.make_gguf import GGUF_ARCH
from crane_mp.testing.make_model import ARCHS, build_config
from crane_mp.testing.make_zoo import FAMILIES as ZOO_FAMILIES, build_zoo_config
from crane_mp.worker.models.bert import BertEncoder
from crane_mp.worker.models.build import model_class
from crane_mp.worker.models.layers import CausalLM

FAMILIES_2026 = ["gemma2", "gemma3", "gemma4", "phi3", "olmo2", "olmo3", "smollm3", "granite", "granite4", "glm4",
                 "cohere2", "exaone4", "seed_oss"]
MOE_FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "glm4_moe", "deepseek_v2",
                "deepseek_v3"]


def test_the_lookups_are_the_ones_the_four_tables_held():
    assert MODEL_TYPE_ALIASES == {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen25": "qwen2",
                                  "qwen3": "qwen3", "hunyuan": "hunyuan", "hunyuan_v1_dense": "hunyuan",
                                  "hunyuan-dense": "hunyuan", "bert": "bert", "roberta": "roberta",
                                  "xlm-roberta": "xlm-roberta", "qwen2_5_vl": "qwen2_5_vl", "whisper": "whisper",
                                  **{name: name for name in FAMILIES_2026 + MOE_FAMILIES}, "gemma3_text": "gemma3",
                                  "gemma4_text": "gemma4", "granitemoehybrid": "granite4", "granitehybrid": "granite4",
                                  "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                                  "deepseek2": "deepseek_v2", "glm4moe": "glm4_moe", "qwen3_5": "qwen3_5",
                                  "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                                  "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next", "qwen35": "qwen3_5",
                                  "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next", "qwen3_vl": "qwen3_vl",
                                  "qwen3_5_vl": "qwen3_5_vl", "qwen3_5_moe_vl": "qwen3_5_moe_vl",
                                  "gemma3_vl": "gemma3_vl", "qwen3_vl_moe": "qwen3_vl_moe"}
    assert HF_CLASSES == {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                          "Qwen3ForCausalLM": "qwen3", "HunYuanDenseV1ForCausalLM": "hunyuan",
                          "BertModel": "bert", "BertForSequenceClassification": "bert", "RobertaModel": "roberta",
                          "RobertaForSequenceClassification": "roberta", "XLMRobertaModel": "xlm-roberta",
                          "XLMRobertaForSequenceClassification": "xlm-roberta",
                          "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                          "WhisperForConditionalGeneration": "whisper",
                          **{cls: name for name in FAMILIES_2026 for cls in ARCHITECTURES[name].hf_classes},
                          "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
                          "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
                          "GraniteMoeForCausalLM": "granitemoe", "GptOssForCausalLM": "gpt_oss",
                          "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                          "DeepseekV3ForCausalLM": "deepseek_v3", "Qwen3_5ForCausalLM": "qwen3_5",
                          "Qwen3_5ForConditionalGeneration": "qwen3_5_vl", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                          "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_vl", "Qwen3NextForCausalLM": "qwen3_next",
                          "Qwen3VLForConditionalGeneration": "qwen3_vl", "Gemma3ForConditionalGeneration": "gemma3_vl",
                          "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe"}
    assert [ARCHITECTURES[name].hf_classes for name in FAMILIES_2026] == [
        ("Gemma2ForCausalLM",), ("Gemma3ForCausalLM",),
        ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("Phi3ForCausalLM",),
        ("Olmo2ForCausalLM",), ("Olmo3ForCausalLM",), ("SmolLM3ForCausalLM",), ("GraniteForCausalLM",),
        ("GraniteMoeHybridForCausalLM",), ("Glm4ForCausalLM",), ("Cohere2ForCausalLM",), ("Exaone4ForCausalLM",),
        ("SeedOssForCausalLM",)]
    assert {gguf: (arch.name, arch.hf_model_type) for gguf, arch in GGUF_ARCHITECTURES.items()} == {
        "llama": ("llama", "llama"), "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"),
        "hunyuan-dense": ("hunyuan", "hunyuan_v1_dense"), "gemma2": ("gemma2", "gemma2"),
        "gemma3": ("gemma3", "gemma3_text"), "gemma4": ("gemma4", "gemma4_text"),
        "olmo2": ("olmo2", "olmo2"), "smollm3": ("smollm3", "smollm3"), "granite": ("granite", "granite"),
        "granitehybrid": ("granite4", "granitemoehybrid"),
        "phi3": ("phi3", "phi3"), "glm4": ("glm4", "glm4"), "cohere2": ("cohere2", "cohere2"),
        "exaone4": ("exaone4", "exaone4"), "seed_oss": ("seed_oss", "seed_oss"),
        "qwen2moe": ("qwen2_moe", "qwen2_moe"), "qwen3moe": ("qwen3_moe", "qwen3_moe"), "olmoe": ("olmoe", "olmoe"),
        "granitemoe": ("granitemoe", "granitemoe"), "gpt-oss": ("gpt_oss", "gpt_oss"),
        "deepseek2": ("deepseek_v2", "deepseek_v2"), "glm4moe": ("glm4_moe", "glm4_moe"),
        "qwen35": ("qwen3_5", "qwen3_5_text"), "qwen35moe": ("qwen3_5_moe", "qwen3_5_moe_text"),
        "qwen3next": ("qwen3_next", "qwen3_next")}
    # llama.cpp's LlamaModel converters permute
    assert PERMUTED_QK_ARCHS == {"llama", "smollm3", "granite", "granitemoe"}
    assert GGUF_ARCH == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                         "hunyuan_v1_dense": "hunyuan-dense", "gemma2": "gemma2", "gemma3_text": "gemma3",
                         "gemma4_text": "gemma4", "olmo2": "olmo2", "phi3": "phi3", "glm4": "glm4",
                         "cohere2": "cohere2", "olmo3": "olmo2", "smollm3": "smollm3", "granite": "granite",
                         "granitemoehybrid": "granitehybrid", "exaone4": "exaone4", "seed_oss": "seed_oss",
                         "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
                         "granitemoe": "granitemoe", "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2",
                         "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe", "qwen3_5_text": "qwen35",
                         "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
                         # the vision-language checkpoints' text, as llama.cpp's converter writes it
                         "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "gemma3": "gemma3"}


NATIVE = sorted(set(ARCHITECTURES) - {TRANSFORMERS})


@pytest.mark.parametrize("arch", NATIVE)
def test_every_architecture_round_trips_its_names(arch):
    row = ARCHITECTURES[arch]
    hf_config = SimpleNamespace(architectures=list(row.hf_classes), model_type=row.hf_model_type)
    assert detect_arch(hf_config) == arch
    # transformers' model type alone names our row, but where it is another row's name (qwen3_5: the
    # vision-language checkpoints' type, our text row's name).
    alone = row.hf_model_type if row.hf_model_type in ARCHITECTURES else arch
    assert detect_arch(SimpleNamespace(architectures=None, model_type=row.hf_model_type)) == alone
    assert MODEL_TYPE_ALIASES[arch] == arch
    if row.encoder:  # no GGUF files: served from safetensors, written by make_encoder
        assert not row.reads_gguf and row.gguf_arch not in GGUF_ARCHITECTURES and arch in ENCODER_ARCHS
        return
    if row.media:  # no GGUF files (but its language model's): served from safetensors, by make_vl and make_whisper
        assert not row.reads_gguf
        assert GGUF_ARCHITECTURES.get(row.gguf_arch) in (None, ARCHITECTURES.get(row.text_arch or ""))
        return
    served = GGUF_ARCHITECTURES.get(row.gguf_arch)
    if row.hf_model_type in ZOO_FAMILIES:  # a 2026 family: its checkpoints written by make_zoo
        # OLMo 3's, Mixtral's and DeepSeek-V3's files are filed under another row's name (olmo2, llama,
        # deepseek2): gguf_row tells them apart.
        assert (served is not None) == (row.reads_gguf or row.name in ("olmo3", "mixtral", "deepseek_v3"))
        if served is None or row.name in ("mixtral", "deepseek_v3"):
            return
    # A GGUF file names the architecture, or (Mistral) one served by the same class, q/k rows alike.
    assert served is row if row.reads_gguf else served.model_class == row.model_class
    assert (row.gguf_arch in PERMUTED_QK_ARCHS) == row.gguf_permuted_qk
    assert GGUF_ARCH[row.hf_model_type] == row.gguf_arch
    assert arch in ARCHS or row.hf_model_type in ZOO_FAMILIES  # make_model or make_zoo can write one


DECODERS = sorted(name for name in NATIVE if not ARCHITECTURES[name].encoder and not ARCHITECTURES[name].media)


def test_every_encoder_is_served_by_the_encoder_class():
    assert {name for name, row in ARCHITECTURES.items() if row.encoder} == {"bert", "roberta", "xlm-roberta"}
    assert all(model_class(name) is BertEncoder for name in ("bert", "roberta", "xlm-roberta"))


def test_media_architectures_take_images_or_audio():
    assert {name: row.media for name, row in ARCHITECTURES.items() if row.media} == {
        "qwen2_5_vl": "image", "qwen3_vl": "image", "qwen3_5_vl": "image", "qwen3_5_moe_vl": "image",
        "gemma3_vl": "image", "qwen3_vl_moe": "image", "whisper": "audio"}
    assert all(model_class(name).media_kind == row.media for name, row in ARCHITECTURES.items() if row.media)


@pytest.mark.parametrize("arch", DECODERS)
def test_every_architecture_has_a_model_class_with_its_qk_norms(arch):
    cls = model_class(arch)
    assert issubclass(cls, CausalLM)
    row = ARCHITECTURES[arch]
    assert (cls.attention_class.qk_norm_position is not None) == (row.qk_norms is not None)


# Granite 4's checkpoints fuse gate and up (shared_mlp.input_linear), which llama.cpp's converter splits
# into ffn_gate and ffn_up: no one-to-one names (tests/correctness/test_gguf_families.py reads its files).
# Experts: transformers 5 stacks gate and up in one tensor, which a file splits (tests/correctness reads them).
@pytest.mark.parametrize("arch", [name for name in DECODERS if ARCHITECTURES[name].gguf_arch in GGUF_ARCHITECTURES
                                  and name != "granite4" and not ARCHITECTURES[name].experts])
def test_every_checkpoint_tensor_round_trips_through_its_gguf_name(arch):
    untied = {"tie_word_embeddings": False}
    config = (build_config(arch, "tiny", overrides=untied) if arch in ARCHS
              else build_zoo_config(ARCHITECTURES[arch].hf_model_type, untied))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    names = [name for name in hf.state_dict() if "rotary_emb" not in name]
    assert any("norm" in name for name in names)
    served = GGUF_ARCHITECTURES[ARCHITECTURES[arch].gguf_arch].name  # Mistral's and OLMo 3's files are read as
    for name in names:                                                # another row's
        assert hf_name(gguf_name(name, served), served) == name


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    gpt2 = SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' has no native implementation \(native: .*llama.*\); "
                                                    r"--model-impl auto or transformers serves it"):
        detect_arch(gpt2, model_impl="native")
    assert detect_arch(gpt2) == TRANSFORMERS  # auto: transformers' own modeling code
    unknown = SimpleNamespace(architectures=["NoSuchModel"], model_type="no_such_model")
    with pytest.raises(UnsupportedModelError, match=r"'no_such_model' is not supported: no native implementation "
                                                    r"\(native: bert, cohere2, deepseek_v2, deepseek_v3, exaone4, "
                                                    r".*\) and transformers has no causal LM for it"):
        model_config_from_hf(unknown)
    with pytest.raises(GGUFFileError, match=r"architecture 'gpt2' is not supported \(supported: "
                                            r"cohere2, deepseek2, exaone4, gemma2, gemma3, gemma4, glm4, glm4moe, "
                                            r"gpt-oss, granite, "
                                            r"granitehybrid, granitemoe, hunyuan-dense, llama, olmo2, olmoe, phi3, "
                                            r"qwen2, qwen2moe, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next, "
                                            r"seed_oss, smollm3\)"):
        read_shape({"general.architecture": "gpt2"}, {}, tmp_path / "m.gguf")


@pytest.mark.parametrize("hf_config", [
    SimpleNamespace(model_type="mamba"),
    SimpleNamespace(model_type="qwen3_next"),
    SimpleNamespace(model_type="olmo3", layer_types=["full_attention", "linear_attention"]),
])
def test_the_transformers_backend_refuses_recurrent_layers_by_name(hf_config):
    with pytest.raises(UnsupportedModelError, match=f"'{hf_config.model_type}' keeps recurrent state"):
        detect_arch(hf_config, model_impl="transformers")


def test_the_transformers_backend_refuses_code_that_attends_on_its_own():
    with pytest.raises(UnsupportedModelError, match="'bloom': transformers' code for it computes attention itself"):
        detect_arch(SimpleNamespace(architectures=["BloomForCausalLM"], model_type="bloom"))


def test_model_impl_transformers_takes_a_natively_served_model_too():
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama")
    assert detect_arch(llama) == "llama"
    assert detect_arch(llama, model_impl="transformers") == TRANSFORMERS
    with pytest.raises(UnsupportedModelError, match="unknown --model-impl 'vllm'"):
        detect_arch(llama, model_impl="vllm")


def test_the_launcher_side_reads_the_registry_without_torch():
    code = ("import sys\n"
            "import pkgutil, importlib, crane_mp.cli, crane_mp.models\n"
            "for found in pkgutil.iter_modules(crane_mp.models.__path__, 'crane_mp.models.'):\n"
            "    importlib.import_module(found.name)\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused_not_broadcast():
    from crane_mp.worker.models.build import build_model
    from crane_mp.worker.platforms import platform_for

    config = model_config_from_hf(build_config("llama", "tiny"))
    model = build_model(config, platform_for("cpu"))
    row = torch.zeros(config.hidden_size)  # copy_ would spread it over every row of a matrix
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        with pytest.raises(ValueError, match=f"'{name}' has shape \\[{config.hidden_size}\\], the model expects"):
            model.load_weights([(name, row)])


def test_a_checkpoint_s_architecture_is_known_from_its_config_alone(tmp_path):
    import json

    from crane_mp.models.config import checkpoint_architecture

    for name, config, arch in (("bert", {"architectures": ["BertModel"]}, "bert"),
                               ("xlmr", {"model_type": "xlm-roberta"}, "xlm-roberta"),
                               ("qwen", {"architectures": ["Qwen3ForCausalLM"]}, "qwen3"),
                               ("whisper", {"architectures": ["WhisperForConditionalGeneration"]}, "whisper"),
                               ("gpt2", {"model_type": "gpt2"}, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        row = checkpoint_architecture(tmp_path / name)
        assert (row.name if row else None) == arch, name
    assert checkpoint_architecture(tmp_path / "qwen", "bert").encoder  # --model-type decides where given
    assert checkpoint_architecture(tmp_path / "missing") is None


@pytest.fixture
def restored_registry():
    """The registry's tables as they were, whatever a test registers."""
    from crane_mp.models import registry

    tables = (registry.ARCHITECTURES, HF_CLASSES, MODEL_TYPE_ALIASES, GGUF_ARCHITECTURES, PERMUTED_QK_ARCHS,
              registry._GGUF_LAYER_BY_HF)
    saved = [table.copy() for table in tables]
    yield
    for table, old in zip(tables, saved):
        table.clear()
        table.update(old)


def test_an_architecture_registered_from_outside_is_served(tmp_path, restored_registry):
    """As vLLM's ModelRegistry.register_model: a row whose class lives outside crane_mp's model folder."""
    import json

    from crane_mp.models.config import checkpoint_architecture
    from crane_mp.models.registry import Architecture, register_model

    row = Architecture("my-llama", "tests.unit.test_model_registry.MyLlama", ("MyLlamaForCausalLM",), "my_llama",
                       "my-llama", gguf_permuted_qk=True)
    register_model(row)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MyLlamaForCausalLM"]}))
    assert checkpoint_architecture(tmp_path) == row
    assert MODEL_TYPE_ALIASES["my_llama"] == MODEL_TYPE_ALIASES["my-llama"] == "my-llama"
    assert GGUF_ARCHITECTURES["my-llama"] == row and "my-llama" in PERMUTED_QK_ARCHS
    assert model_class("my-llama") is MyLlama
    with pytest.raises(ValueError, match="already served"):
        register_model(row)
    with pytest.raises(ValueError, match="LlamaForCausalLM already served as 'llama'"):
        register_model(Architecture("other", "llama.LlamaForCausalLM", ("LlamaForCausalLM",), "other", "other"))


class MyLlama(CausalLM):
    """A model class outside crane_mp/worker/models, as a plugin package would hold it."""


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_attention_the_transformers_backend_cannot_page_is_refused_by_name_not_served_wrong(model_type):
    config = SimpleNamespace(architectures=["X"], model_type=model_type)
    assert detect_arch(config) == model_type  # natively
    with pytest.raises(UnsupportedModelError, match=rf"model_type '{model_type}': .* is not computed by the "
                                                    "transformers backend's paged attention; --model-impl native"):
        detect_arch(config, model_impl="transformers")

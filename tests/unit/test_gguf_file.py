"""GGUF files: finding them, reading their metadata, and refusing bad ones with one line."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from crane_mp.models.config import load_gguf_config, load_model_config
from crane_mp.models.gguf_file import GGUFFileError, check_gguf, describe_types, resolve_model_source
from crane_mp.testing.make_gguf import make_gguf
from crane_mp.testing.make_model import make_model

SIZE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("hf") / "qwen3", overrides=SIZE)


@pytest.fixture(scope="module")
def good(model_dir, tmp_path_factory):
    return make_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "model-Q4_K_M.gguf", "Q4_K_M")


def patched(good, tmp_path, find: bytes, offset: int, new: bytes):
    """A copy of `good` with `new` written `offset` bytes after the first occurrence of `find`."""
    data = bytearray(good.read_bytes())
    at = data.index(find) + offset
    data[at : at + len(new)] = new
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return path


def test_metadata_gives_the_same_config_as_config_json(model_dir, good):
    ours, hf = load_gguf_config(good), load_model_config(model_dir)
    for field in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rope_theta"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert ours.eos_token_ids and ours.eos_token_ids[0] in hf.eos_token_ids
    assert ours.torch_dtype == "float32"


def test_types_are_counted(good):
    types = check_gguf(good).types
    assert set(types) == {"Q4_K", "Q6_K", "F32"}
    assert describe_types(types).startswith(f"{types.most_common(1)[0][0]} x ")


def test_resolve_model_source(model_dir, good, tmp_path):
    assert resolve_model_source(good).format == "gguf"
    assert resolve_model_source(model_dir).format == "safetensors"
    holder = tmp_path / "holder"
    holder.mkdir()
    shutil.copy(good, holder / "m.gguf")
    source = resolve_model_source(holder)
    assert (source.format, source.gguf_file.name, source.model_dir) == ("gguf", "m.gguf", holder.resolve())
    shutil.copy(good, holder / "n.gguf")
    with pytest.raises(FileNotFoundError, match="several .gguf files"):
        resolve_model_source(holder)
    with pytest.raises(FileNotFoundError, match="holds no .gguf"):
        resolve_model_source(model_dir, "gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source(tmp_path / "nothing.gguf")


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncated", "truncated or corrupt"),
        ("magic", "not a readable GGUF"),
        ("arch", "architecture 'qwen9' is not supported"),
        ("shape", "the metadata implies"),
        ("type", "has type Q2_K, which crane-mp cannot serve"),
        ("unknown-type", "has type id 99, which is no GGML type"),
        ("layers", "metadata gives 1000000000 layers, but the file holds"),
        ("context", "metadata gives a context of 4000000000 tokens"),
    ],
)
def test_bad_files_are_refused_with_one_line(good, tmp_path, case, message):
    if case == "truncated":
        path = tmp_path / "bad.gguf"
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "magic":
        path = patched(good, tmp_path, b"GGUF", 0, b"GGML")
    elif case == "arch":
        path = patched(good, tmp_path, b"general.architecture", len("general.architecture") + 4 + 8, b"qwen9")
    elif case in ("layers", "context"):  # claims sized before anything is built from them
        key = b"qwen3.block_count" if case == "layers" else b"qwen3.context_length"
        path = patched(good, tmp_path, key, len(key) + 4, struct.pack("<I", 10**9 if case == "layers" else 4 * 10**9))
    elif case == "shape":  # feed_forward_length 512 -> 640: every ffn tensor disagrees
        path = patched(good, tmp_path, b"qwen3.feed_forward_length", len("qwen3.feed_forward_length") + 4,
                       struct.pack("<I", 640))
    else:  # blk.0.attn_q.weight's type id (after name, n_dims and two dims) -> Q2_K (10, smaller) or 99
        name = b"blk.0.attn_q.weight"
        path = patched(good, tmp_path, name, len(name) + 4 + 16, struct.pack("<I", 10 if case == "type" else 99))
    with pytest.raises(GGUFFileError, match=message) as err:
        check_gguf(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)

    run = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert run.stderr.strip().count("\n") == 0 and message in run.stderr and "Traceback" not in run.stderr


def test_a_linked_file_keeps_its_own_name_and_folder(good, tmp_path):
    """A hub cache's snapshots/<rev>/model.gguf is a symlink into blobs/<hash>."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    shutil.copy(good, tmp_path / "blobs" / "0123abcd")
    (tmp_path / "snap" / "model-Q4_K_M.gguf").symlink_to(tmp_path / "blobs" / "0123abcd")
    source = resolve_model_source(tmp_path / "snap" / "model-Q4_K_M.gguf")
    assert (source.format, source.model_dir, source.gguf_file.name) == ("gguf", tmp_path / "snap", "model-Q4_K_M.gguf")
    assert check_gguf(source.gguf_file).types == check_gguf(good).types


def test_big_endian_files_are_refused(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFileError, match="big-endian"):
        check_gguf(path)


def test_safetensors_flag_on_a_gguf_file_is_refused(good):
    run = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(good), "--format", "safetensors"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is a file" in run.stderr and run.stderr.strip().count("\n") == 0


def test_keys_in_a_layer_marked_recurrent_give_its_kv_heads_and_a_truly_recurrent_layer_is_refused(tmp_path):
    from crane_mp.models.gguf_file import read_shape

    meta = {"general.architecture": "granitehybrid", "granitehybrid.embedding_length": 64,
            "granitehybrid.attention.head_count": 4, "granitehybrid.attention.head_count_kv": [0, 0],
            "granitehybrid.block_count": 2, "granitehybrid.feed_forward_length": 96,
            "granitehybrid.attention.layer_norm_rms_epsilon": 1e-6}
    layer = {"attn_norm": (64,), "ffn_norm": (64,), "attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64),
             "attn_output": (64, 64), "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}
    dims = {"token_embd.weight": (512, 64), "output_norm.weight": (64,),
            **{f"blk.{i}.{name}.weight": shape for i in range(2) for name, shape in layer.items()}}
    assert read_shape(meta, dims, tmp_path / "g.gguf").layer_dims(1) == (16, 2, 96)
    del dims["blk.1.attn_k.weight"]
    with pytest.raises(GGUFFileError, match="layer 1 keeps recurrent state"):
        read_shape(meta, dims, tmp_path / "g.gguf")

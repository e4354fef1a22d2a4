"""Effective settings: flag defaults < --config file < CRANE_* environment < flags, each value checked
by the flag's own parser, and where every value came from."""

from __future__ import annotations

import pytest

from crane_mp.cli import build_parser, default_num_frontends, parse_args
from crane_mp.settings import SettingsError, resolve
from crane_mp.testing.make_model import make_model


def layered(tmp_path, file_text: str | None, argv: list[str], environ: dict[str, str]):
    args = list(argv)
    if file_text is not None:
        path = tmp_path / "c.toml"
        path.write_text(file_text)
        args = ["--config", str(path), *args]
    return resolve(build_parser(), args, environ)


def test_each_layer_overrides_the_one_below(tmp_path):
    text = 'max-queue = 5\nmax_concurrent = 4\nport = 9000\nno-prefix-cache = true\nlog-format = "json"\n'
    args, sources = layered(tmp_path, text, ["--port", "9100"], {"CRANE_MAX_QUEUE": "7", "CRANE_PORT": "9200"})
    assert (args.port, args.max_queue, args.max_concurrent, args.no_prefix_cache) == (9100, 7, 4, True)
    assert sources["port"] == "cli" and sources["max_queue"] == "env CRANE_MAX_QUEUE"
    assert sources["max_concurrent"] == f"file {tmp_path / 'c.toml'}" and sources["block_size"] == "default"
    assert args.log_format == "json"


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("off", False), ("", False)])
def test_switches_from_the_environment(tmp_path, value, expected):
    args, _ = layered(tmp_path, None, [], {"CRANE_CPU": value})
    assert args.cpu is expected


@pytest.mark.parametrize("text, message", [
    ("max-concurent = 3\n", "unknown key 'max-concurent' (did you mean 'max-concurrent'?)"),
    ("[server]\nport = 1\n", "unknown table 'server'"),
    ("port = 70000\n", "--port: must be a TCP port"),
    ("cpu = 3\n", "--cpu is a switch: use true or false"),
    ('log-format = "xml"\n', "--log-format: invalid choice 'xml'"),
    ("port = [1]\n", "--port takes one value"),
    ("port = \n", "is not valid TOML"),
])
def test_a_bad_file_is_one_error_naming_the_key_and_the_file(tmp_path, text, message):
    with pytest.raises(SettingsError) as err:
        layered(tmp_path, text, [], {})
    assert message in str(err.value) and str(tmp_path / "c.toml") in str(err.value)


def test_crane_config_names_the_file_when_the_flag_does_not(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("max-queue = 9\n")
    args, sources = resolve(build_parser(), [], {"CRANE_CONFIG": str(path)})
    assert args.max_queue == 9 and sources["max_queue"] == f"file {path}"


def test_a_bad_variable_names_itself(tmp_path):
    with pytest.raises(SettingsError, match="environment variable CRANE_MAX_QUEUE: --max-queue: expected an integer"):
        layered(tmp_path, None, [], {"CRANE_MAX_QUEUE": "many"})


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        resolve(build_parser(), ["--config", str(tmp_path / "none.toml")], {})


def test_server_config_carries_settings_and_flags_outrank_the_files_demo(tmp_path):
    tiny_model_dir = make_model("qwen3", "tiny", tmp_path / "m")
    path = tmp_path / "c.toml"
    path.write_text('demo = true\nmax-queue = 3\napi-key = "s3cret"\n')
    config = parse_args(["--config", str(path), "--model-path", str(tiny_model_dir)],
                        {"CRANE_MAX_QUEUE_SIZE": "1", "CRANE_MP_ISA": "avx2", "CRANE_EXTRA_ARGS": "x"})
    assert config.max_queue == 3 and config.engine.model_path == str(tiny_model_dir)
    assert config.settings["demo"] == {"value": False, "source": "cli"}
    assert config.settings["api-key"] == {"value": "(set)", "source": f"file {path}"}
    assert config.unknown_env == ("CRANE_EXTRA_ARGS", "CRANE_MAX_QUEUE_SIZE")  # the old unit's variable too


def test_frontend_count_follows_the_cores():
    assert [default_num_frontends(n) for n in (1, 2, 8, 16, 64)] == [1, 1, 1, 2, 4]


def test_a_server_open_to_the_network_without_a_key_is_warned_about(tmp_path):
    from crane_mp.config import EngineConfig, ServerConfig
    from crane_mp.launch import exposure_warnings

    engine = EngineConfig(model_path="m")
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warnings(ServerConfig(engine=engine, model_name="m", host=host)) == []
    [warning] = exposure_warnings(ServerConfig(engine=engine, model_name="m", host="0.0.0.0"))
    assert "0.0.0.0 without --api-key" in warning
    assert exposure_warnings(ServerConfig(engine=engine, model_name="m", host="0.0.0.0", api_key="k")) == []
    lora = EngineConfig(model_path="m", runtime_lora=True, lora_root=str(tmp_path))
    [warning] = exposure_warnings(ServerConfig(engine=lora, model_name="m"))
    assert "run-time LoRA loading" in warning and "--admin-api-key" in warning
    assert exposure_warnings(ServerConfig(engine=lora, model_name="m", admin_api_key="a")) == []


def test_media_bounds_reach_the_server_config(tmp_path):
    model_dir = make_model("qwen3", "tiny", tmp_path / "m")
    defaults = parse_args(["--model-path", str(model_dir)], {})
    assert (defaults.allowed_media_ports, defaults.allow_private_media_addresses) == ((80, 443), False)
    assert (defaults.max_images_per_request, defaults.audio_sample_limit) == (32, 3600 * 96000)
    config = parse_args(["--model-path", str(model_dir), "--allowed-media-ports", "8080", "8443",
                         "--allow-private-media-addresses", "--max-images-per-request", "4"],
                        {"CRANE_MAX_AUDIO_SAMPLES": "1000"})
    assert (config.allowed_media_ports, config.allow_private_media_addresses) == ((8080, 8443), True)
    assert (config.max_images_per_request, config.audio_sample_limit) == (4, 1000)

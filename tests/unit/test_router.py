"""Several models in one server, without starting any: how the command names them, how a request's model
is found and checked against the route, and how the models' metrics merge with the router's."""

from __future__ import annotations

import asyncio

import pytest

from crane_mp.config import MemoryLimit
from crane_mp.router.command import model_set
from crane_mp.router.metrics import merge_expositions
from crane_mp.testing.make_encoder import make_encoder
from crane_mp.testing.make_model import make_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"chat": make_model("qwen3", "tiny", root / "chat", seed=1),
            "embedder": make_encoder("bert", root / "embedder", "embed", "mean", seed=2)}


def test_one_model_path_is_a_one_model_server(models):
    assert model_set(["--model-path", str(models["chat"])], {}) is None


def test_model_paths_name_their_models_and_share_the_budget(models):
    argv = ["--model-path", f"chat={models['chat']}", "--model-path", str(models["embedder"]), "--port", "9000",
            "--gpu-memory-limit", "4G", "--api-key", "k", "--load-on-demand", "--pinned-models", "chat"]
    served = model_set(argv, {})
    assert [spec.name for spec in served.models] == ["chat", "embedder"]  # a bare path: its directory's name
    assert [spec.config.engine.task for spec in served.models] == ["generate", "embed"]
    assert [spec.pinned for spec in served.models] == [True, False]
    assert served.budget == MemoryLimit(num_bytes=4 << 30) and served.load_on_demand
    assert served.public.port == 9000 and served.public.api_key == "k"
    for spec in served.models:  # the router checks keys; each model has half the budget for its plan
        assert spec.config.api_key is None and spec.config.num_frontends == 1
        assert spec.config.engine.memory_limit == MemoryLimit(num_bytes=2 << 30)


def test_models_tables_carry_each_models_own_settings(models, tmp_path):
    config = tmp_path / "server.toml"
    config.write_text(f"""
port = 9001
max-seq-len = 256

[[models]]
model-path = "{models['chat']}"
model-name = "assistant"
pinned = true
gpu-memory-limit = "1G"

[[models]]
model-path = "{models['embedder']}"
served-model-name = "vectors"
task = "embed"
max-seq-len = 64
devices = "1"
""")
    served = model_set(["--config", str(config), "--gpu-memory-limit", "3G"], {})
    chat, embedder = served.models
    assert embedder.name == "vectors"  # vLLM's spelling of model-name
    assert (chat.name, chat.pinned, chat.config.engine.memory_limit) == ("assistant", True,
                                                                         MemoryLimit(num_bytes=1 << 30))
    assert embedder.config.engine.memory_limit == MemoryLimit(num_bytes=(3 << 30) // 2)
    assert (chat.config.engine.max_model_len, embedder.config.engine.max_model_len) == (256, 64)
    assert served.public.port == 9001
    assert (chat.config.cuda_devices, embedder.config.cuda_devices) == (None, "1")


@pytest.mark.parametrize("table, message", [
    ('[[models]]\nmodel-path = "{chat}"\nmodel-name = "x"\n[[models]]\nmodel-path = "{emb}"\nmodel-name = "x"\n',
     "two models are named 'x'"),
    ('[[models]]\nmodel-path = "{chat}"\nbogus = 1\n', "unknown key 'bogus'"),
    ('[[models]]\nmodel-name = "x"\n', "model-path is missing"),
    ('[[models]]\nmodel-path = "{chat}"\ndevices = "cuda:1"\n', "devices must list GPU indices"),
    ('[[models]]\nmodel-path = "{chat}"\ntask = "dance"\n', "invalid choice: 'dance'"),
])
def test_a_bad_models_table_fails_at_start_naming_it(models, tmp_path, capsys, table, message):
    config = tmp_path / "bad.toml"
    config.write_text(table.format(chat=models["chat"], emb=models["embedder"]))
    with pytest.raises(SystemExit) as stop:
        model_set(["--config", str(config)], {})
    assert message in str(stop.value.code) + capsys.readouterr().err


def test_argparse_errors_name_the_model(models, tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(f'[[models]]\nmodel-path = "{models["chat"]}"\nmax-seq-len = "many"\n')
    with pytest.raises(SystemExit):
        model_set(["--config", str(config)], {})
    assert "in the settings of model 1" in capsys.readouterr().err


def test_flags_and_tables_together_and_unknown_pins_are_refused(models, tmp_path):
    config = tmp_path / "both.toml"
    config.write_text(f'[[models]]\nmodel-path = "{models["chat"]}"\n')
    with pytest.raises(SystemExit, match="not both"):
        model_set(["--config", str(config), "--model-path", str(models["chat"]), "--model-path",
                   str(models["embedder"])], {})
    with pytest.raises(SystemExit, match="names no served model: ghost"):
        model_set(["--model-path", str(models["chat"]), "--model-path", str(models["embedder"]),
                   "--pinned-models", "ghost"], {})


def test_a_request_finds_its_model_or_a_clear_error(models):
    from crane_mp.frontend.web.errors import ApiError
    from crane_mp.router.app import pick_model
    from crane_mp.router.manager import ModelManager

    served = model_set(["--model-path", f"chat={models['chat']}", "--model-path",
                        f"embedder={models['embedder']}", "--lora-modules", "tone=/nowhere"], {})

    async def check() -> None:
        manager = ModelManager(served, "/tmp")
        assert pick_model(manager, "/v1/chat/completions", "chat") == "chat"
        assert pick_model(manager, "/v1/chat/completions", "tone") == "chat"  # an adapter: its base model
        assert pick_model(manager, "/v1/embeddings", None) == "embedder"  # none named: the route's task
        assert pick_model(manager, "/tokenize", None) == "chat"  # a route of any task: the first model
        with pytest.raises(ApiError) as unknown:
            pick_model(manager, "/v1/completions", "nowhere")
        assert unknown.value.status == 404 and "nowhere" in unknown.value.message
        with pytest.raises(ApiError) as wrong:
            pick_model(manager, "/v1/embeddings", "chat")
        assert wrong.value.status == 400 and "--task generate" in wrong.value.message

    asyncio.run(check())


def test_metrics_merge_family_by_family():
    a = ('# HELP x_total things\n# TYPE x_total counter\nx_total{model_name="a"} 1.0\n'
         '# HELP y gauge\n# TYPE y gauge\ny{model_name="a"} 2.0\n')
    b = '# HELP x_total things\n# TYPE x_total counter\nx_total{model_name="b"} 3.0\n'
    assert merge_expositions([a, b]).splitlines() == [
        "# HELP x_total things", "# TYPE x_total counter", 'x_total{model_name="a"} 1.0', 'x_total{model_name="b"} 3.0',
        "# HELP y gauge", "# TYPE y gauge", 'y{model_name="a"} 2.0']


def test_the_model_is_read_from_json_bodies_uploads_and_the_query():
    from aiohttp.test_utils import make_mocked_request

    from crane_mp.router.app import named_model

    def request(content_type: str, query: str = ""):  # named_model takes the body read beside it
        return make_mocked_request("POST", "/v1/x" + query, headers={"Content-Type": content_type})

    chat = b'{"model": "chat", "x": 1}'
    assert named_model(request("application/json"), chat) == "chat"
    assert named_model(request("application/json", "?model=q"), b"[1, 2]") == "q"  # no object: the query
    assert named_model(request("application/json"), b"{bad") is None
    body = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav'
            b'\r\n\r\nRIFF\x00\xff\r\n--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--B--\r\n')
    assert named_model(request("multipart/form-data; boundary=B"), body) == "whisper"


def test_pinned_models_may_come_from_the_environment(models):
    argv = ["--model-path", f"chat={models['chat']}", "--model-path", f"embedder={models['embedder']}"]
    served = model_set(argv, {"CRANE_PINNED_MODELS": "embedder"})
    assert [spec.pinned for spec in served.models] == [False, True]


def test_the_router_refuses_a_web_pages_cross_origin_post(models):
    from aiohttp.test_utils import TestClient, TestServer

    from crane_mp.router.app import create_router_app
    from crane_mp.router.manager import ModelManager

    served = model_set(["--model-path", f"chat={models['chat']}", "--model-path", f"embedder={models['embedder']}"],
                       {})

    async def check() -> None:
        async with TestClient(TestServer(create_router_app(ModelManager(served, "/tmp")))) as client:
            for path in ("/sleep", "/abort_request", "/v1/completions"):
                response = await client.post(path, data="x", headers={"Origin": "http://evil.example",
                                                                      "Content-Type": "text/plain"})
                assert response.status == 415, path
            assert (await client.get("/v1/models")).status == 200

    asyncio.run(check())

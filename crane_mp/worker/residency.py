"""What the worker keeps resident between requests: sleep, wake-up, and new weights from disk.

Sleep level 1 frees the KV cache (and a hybrid model's state pool); on CUDA the weights also move to
host memory, for a wake that copies them back instead of reading the checkpoint. Level 2 drops the
weights too: the wake reads them from disk again. Both only ever run while no request is on the worker
(the scheduler waits for that), so nothing computed is lost: the prefix cache is flushed with the KV.

New weights (update_weights_from_disk) are read beside the step loop into a second model, which must
have the served model's shapes; the swap, once the scheduler has drained every request the old weights
started, builds a runner around them on the same KV block count and drops the old model.
"""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass, field

import torch

from crane_mp.config import EngineConfig, pools_outputs
from crane_mp.heap import malloc_trim
from crane_mp.models.config import ModelConfig, load_gguf_config, load_model_config
from crane_mp.models.gguf_file import resolve_model_source
from crane_mp.protocol import LoraAdapter
from crane_mp.worker.bootstrap import LoadedWorker
from crane_mp.worker.step.runner import ModelRunner
from crane_mp.worker.weights.loader import load_model
from crane_mp.worker.weights.lora import load_adapter, load_adapters

log = logging.getLogger(__name__)

# What must agree between the served model and new weights for the KV plan, the scheduler's limits
# and the frontend's tokenizer to stay right.
_SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim")


class WeightsError(ValueError):
    """New weights that cannot replace the served ones; the message says why."""


@dataclass(slots=True)
class Residency:
    config: EngineConfig
    loaded: LoadedWorker
    weights_path: str = ""  # where the weights served now were read from
    sleep_level: int = 0
    adapters: dict[int, LoraAdapter] = field(default_factory=dict)  # run-time adapters, to install again
    _staged: tuple[str, torch.nn.Module] | None = None  # new weights read, waiting for the swap
    _host_copy: bool = False  # level 1 on CUDA: the weights wait in host memory
    _graph_sizes: list[int] = field(default_factory=list)  # the decode graphs start-up captured (CUDA)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.weights_path = self.weights_path or self.config.model_path
        graphs = self.loaded.runner.decode_graphs
        self._graph_sizes = list(graphs.sizes) if graphs is not None else []

    @property
    def runner(self) -> ModelRunner:
        return self.loaded.runner

    # ---- sleep ----------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        runner = self.runner
        assert not runner.requests, "sleep with requests on the worker"
        if self.sleep_level == 0:
            _drop_kv(runner)
            if runner.platform.device.type == "cuda" and level == 1:
                runner.model._apply(lambda t: t.to("cpu", non_blocking=False))
                self._host_copy = True
        if level == 2 and self.sleep_level < 2:
            runner.model = None
            self._host_copy = False
        self.sleep_level = max(self.sleep_level, level)
        _give_back(runner)
        log.info("asleep at level %d: %s freed", self.sleep_level,
                 "the KV cache" if self.sleep_level == 1 else "the KV cache and the weights")

    def wake(self) -> None:
        if self.sleep_level == 0:
            return
        if self.runner.model is None:
            self._install(self._read(self.weights_path))
        else:
            if self._host_copy:
                device = self.runner.platform.device
                self.runner.model._apply(lambda t: t.to(device))
                self._host_copy = False
            _allocate_kv(self.runner, self.loaded)
            if self._graph_sizes:  # they held the freed cache's addresses
                self.runner.enable_decode_graphs(self._graph_sizes)
        self.sleep_level = 0
        log.info("awake: weights and KV cache resident")

    # ---- new weights ----------------------------------------------------------------------------

    def stage(self, path: str) -> None:
        """Read the weights at `path` beside the step loop (a background thread); raises WeightsError or
        the loader's error, the served weights untouched."""
        model = self._read(path)
        with self._lock:
            self._staged = (path, model)

    def swap(self) -> str:
        """Serve the staged weights from now on (no request on the worker); returns their path."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            raise WeightsError("no new weights were read")
        path, model = staged
        assert not self.runner.requests, "weights swapped with requests on the worker"
        self._install(model)
        self.weights_path, self.sleep_level, self._host_copy = path, 0, False
        log.info("serving the weights from %s", path)
        return path

    def discard(self) -> None:
        with self._lock:
            self._staged = None
        _give_back(self.runner)

    def _read(self, path: str) -> torch.nn.Module:
        loaded, config = self.loaded, self.config
        source = resolve_model_source(path, config.model_format)
        if source.format == "gguf":
            new_config = load_gguf_config(source.gguf_file, config.model_type)
        else:
            new_config = load_model_config(source.model_dir, config.model_type, config.model_impl)
        _check_same_shapes(loaded.model_config, new_config, path)
        int8 = loaded.quantized_activations == "int8"
        model, _ = load_model(new_config, source, loaded.dtype, loaded.platform, False, pools_outputs(config.task),
                              lora=config.lora, int8_activations=int8, drop_file_pages=not config.keep_page_cache)
        if config.lora_modules:
            load_adapters(model, config.lora_modules, config.max_lora_rank, loaded.dtype, loaded.platform)
        for adapter in self.adapters.values():
            load_adapter(model, adapter.lora_id, adapter.name, adapter.path, config.max_lora_rank, loaded.dtype,
                         loaded.platform)
        loaded.platform.tune_linears(model, config.max_num_seqs)
        loaded.platform.warm_kernel_caches(model, max(config.max_num_batched_tokens, config.max_num_seqs))
        return model

    def _install(self, model: torch.nn.Module) -> None:
        """A runner around `model` with the served one's settings and KV block count, in its place."""
        old = self.runner
        runner = ModelRunner(model, old.block_size, old.max_positions, old.platform, old.attention_backend,
                             old.grammars, old.kv_dtype, old.share_tokens, old.recurrent_dtype)
        if old.model is not None and runner.kv_bytes_per_token() != old.kv_bytes_per_token():
            raise WeightsError("the new weights' KV cache would differ from the served model's")
        _drop_kv(old)
        old.model = None
        _give_back(old)
        self.loaded.runner = runner
        _allocate_kv(runner, self.loaded)
        if self._graph_sizes:
            runner.enable_decode_graphs(self._graph_sizes)

    def remember_adapter(self, adapter: LoraAdapter) -> None:
        self.adapters[adapter.lora_id] = adapter

    def forget_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)


def _check_same_shapes(served: ModelConfig, new: ModelConfig, path: str) -> None:
    for name in _SHAPE_FIELDS:
        if getattr(served, name) != getattr(new, name):
            raise WeightsError(f"the weights at {path} are not this model's shape ({name} {getattr(new, name)}, "
                               f"served: {getattr(served, name)}): start a server for them")


def _drop_kv(runner: ModelRunner) -> None:
    if runner.model is not None:
        for attn in runner.model.attention_layers():
            attn.k_cache = attn.v_cache = None
    runner.decode_graphs = None
    runner.state_pool = None


def _allocate_kv(runner: ModelRunner, loaded: LoadedWorker) -> None:
    runner.allocate_kv_cache(loaded.kv_plan.num_blocks)
    if runner.state_layers:
        runner.allocate_state_pool(loaded.kv_plan.state_slots)


def _give_back(runner: ModelRunner) -> None:
    """Return what was freed to the device or the operating system now, not at the next trim."""
    frozen = gc.get_freeze_count() > 0  # the worker froze what start-up allocated (process.py): the old
    gc.unfreeze()  # model is among it
    gc.collect()
    if frozen:
        gc.freeze()
    if runner.platform.device.type == "cuda":
        torch.cuda.empty_cache()
    trim = malloc_trim()
    if trim is not None:
        trim(0)

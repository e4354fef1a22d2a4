"""Whisper (speech to text): an audio encoder, and a text decoder whose self-attention is paged like
any decoder's and whose cross-attention reads the encoder's keys and values of its request's window.

One request is one 30 s window: its MediaInput holds the window's log-mel features. The encoder runs
once, the first step the request computes, and each decoder layer's cross-attention keys and values
are kept with the request (through preemptions) until it finishes. Names are transformers'
checkpoint names, so loading is a prefix-stripping copy; proj_out is tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.protocol import MediaInput
from crane_mp.worker.models.checkpoint import copy_named
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import MediaSpan, get_forward_context

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class WhisperAttention(nn.Module):
    """transformers' WhisperAttention: queries scaled before the product, no bias on the key projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def heads_of(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(x).view(x.shape[0], self.heads, self.head_dim)  # [T, H, D]

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads_of(self.q_proj, x) * self.scaling


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, act) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        h = self.self_attn_layer_norm(x)
        # [1, H, T, D] as transformers lays them out: 3-D inputs take another SDPA kernel on CPU.
        q, k, v = (t.transpose(0, 1)[None] for t in (attn.query(h), attn.heads_of(attn.k_proj, h),
                                                       attn.heads_of(attn.v_proj, h)))
        mixed = F.scaled_dot_product_attention(q, k, v, scale=1.0)[0].transpose(0, 1).reshape(x.shape)
        x = x + attn.out_proj(mixed)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        dim = hf.d_model
        self.frames = hf.max_source_positions * 2  # conv2 halves the mel frames
        self.embed_scale = dim**0.5 if hf.scale_embedding else 1.0
        self.conv1 = nn.Conv1d(hf.num_mel_bins, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(hf.max_source_positions, dim)
        act = ACTIVATIONS[hf.activation_function]
        self.layers = nn.ModuleList(EncoderLayer(dim, hf.encoder_attention_heads, hf.encoder_ffn_dim, act)
                                    for _ in range(hf.encoder_layers))
        self.layer_norm = nn.LayerNorm(dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [mel bins, frames] -> [positions, dim]."""
        if features.shape[-1] != self.frames:
            raise ValueError(f"a Whisper window holds {self.frames} mel frames, not {features.shape[-1]}")
        x = F.gelu(self.conv2(F.gelu(self.conv1(features[None]))))[0].transpose(0, 1)  # [positions, dim]
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


@dataclass(slots=True)
class AudioWindow:
    """A request's window: its features until encoded, then each decoder layer's cross keys and values."""

    features: torch.Tensor | None
    cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: [H, positions, D] each


class DecoderLayer(EncoderLayer):
    """An encoder layer's modules, and cross-attention over the request's window between its two halves."""

    def __init__(self, dim: int, heads: int, ffn: int, act) -> None:
        super().__init__(dim, heads, ffn, act)
        self.encoder_attn = WhisperAttention(dim, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.k_cache: torch.Tensor | None = None  # bound by the runner, like PagedSelfAttention's
        self.v_cache: torch.Tensor | None = None
        self.index = 0  # which of a window's cross keys and values are this layer's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        attn = self.self_attn
        h = self.self_attn_layer_norm(x)
        k, v = attn.heads_of(attn.k_proj, h), attn.heads_of(attn.v_proj, h)
        heads, dim = k.shape[1:]
        self.k_cache.view(-1, heads, dim).index_copy_(0, ctx.attn.slot_mapping, k.to(self.k_cache.dtype))
        self.v_cache.view(-1, heads, dim).index_copy_(0, ctx.attn.slot_mapping, v.to(self.v_cache.dtype))
        x = x + attn.out_proj(self._self_attend(attn.query(h), ctx.media))
        x = x + self._cross_attend(self.encoder_attn_layer_norm(x), ctx.media)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))

    def _self_attend(self, q: torch.Tensor, spans: list[MediaSpan]) -> torch.Tensor:
        """Each request's rows over its cached keys, one SDPA call each as transformers' generate makes
        them (a causal prompt, then one row at a time): decoding stays within float noise of it, where
        near-ties of a random model's logits would otherwise flip. Windows are short (448 positions)."""
        heads, dim = q.shape[1:]
        block_size = self.k_cache.shape[1]
        parts = []
        for span in spans:
            positions = torch.arange(span.end)
            slots = torch.tensor(span.blocks, dtype=torch.long)[positions // block_size] * block_size
            slots = (slots + positions % block_size).to(q.device)
            k, v = (cache.view(-1, heads, dim).index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
                    for cache in (self.k_cache, self.v_cache))  # [1, H, end, D]
            rows = q[span.row : span.row + span.end - span.start].transpose(0, 1)[None]  # [1, H, n, D]
            mask, causal = None, span.start == 0 and span.end > 1  # a whole prompt: transformers' causal call
            if span.start and span.end - span.start > 1:  # a later chunk: row i sees positions to start + i
                mask = positions[None, :].to(q.device) <= torch.arange(span.start, span.end, device=q.device)[:, None]
            out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, is_causal=causal, scale=1.0)
            parts.append(out[0].transpose(0, 1))
        return torch.cat(parts).reshape(q.shape[0], heads * dim)

    def _cross_attend(self, h: torch.Tensor, spans: list[MediaSpan]) -> torch.Tensor:
        """Each request's rows attend to its own window (rows of a step are grouped by request)."""
        q = self.encoder_attn.query(h).transpose(0, 1)  # [H, T, D]
        parts = []
        for span in spans:
            k, v = span.state.cross[self.index]
            rows = q[None, :, span.row : span.row + span.end - span.start]
            parts.append(F.scaled_dot_product_attention(rows, k[None], v[None], scale=1.0)[0])
        mixed = torch.cat(parts, dim=1).transpose(0, 1).reshape(h.shape)
        return self.encoder_attn.out_proj(mixed)


class WhisperDecoder(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        dim = hf.d_model
        self.embed_scale = dim**0.5 if hf.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(hf.vocab_size, dim, _weight=torch.empty(hf.vocab_size, dim))
        self.embed_positions = nn.Embedding(hf.max_target_positions, dim)
        act = ACTIVATIONS[hf.activation_function]
        self.layers = nn.ModuleList(DecoderLayer(dim, hf.decoder_attention_heads, hf.decoder_ffn_dim, act)
                                    for _ in range(hf.decoder_layers))
        for index, layer in enumerate(self.layers):
            layer.index = index
        self.layer_norm = nn.LayerNorm(dim)


class WhisperModel(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(hf)
        self.decoder = WhisperDecoder(hf)


class WhisperForConditionalGeneration(nn.Module):
    """The served model: decoder hidden states per token, logits through the tied output projection."""

    media_kind = "audio"
    vocab_parallel = False

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__()
        self.config = config
        self.model = WhisperModel(config.hf_config)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.decoder.layer_norm.weight.dtype

    @property
    def logits_size(self) -> int:
        return self.config.vocab_size

    def attention_layers(self) -> list[DecoderLayer]:
        return list(self.model.decoder.layers)

    def media_state(self, prompt_ids: list[int], media: list[MediaInput]) -> AudioWindow:
        audio = [item for item in media if item.kind == "audio"]
        if len(audio) != 1:
            raise ValueError(f"a Whisper request transcribes one audio window, not {len(audio)}")
        values = np.frombuffer(audio[0].values, dtype=np.float32).reshape(audio[0].shape)
        return AudioWindow(torch.from_numpy(values.copy()))

    def profile_media_state(self) -> AudioWindow:
        """A window of silence-level features, for the profiling steps (its encoder pass included)."""
        encoder = self.model.encoder
        weight = encoder.conv1.weight
        return AudioWindow(torch.zeros(encoder.conv1.in_channels, encoder.frames, dtype=weight.dtype,
                                       device=weight.device))

    def prepare_media(self, spans: list[MediaSpan], positions: torch.Tensor) -> None:
        """Encode the windows first computed this step (one encoder pass each); the decoder layers read
        their keys and values from the spans."""
        for span in spans:
            window = span.state
            if window.cross is None:
                weight = self.model.encoder.conv1.weight
                encoded = self.model.encoder(window.features.to(device=weight.device, dtype=weight.dtype))
                window.cross = [self._cross_kv(layer.encoder_attn, encoded) for layer in self.model.decoder.layers]
                window.features = None

    @staticmethod
    def _cross_kv(attn: WhisperAttention, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (attn.heads_of(attn.k_proj, encoded).transpose(0, 1).contiguous(),
                attn.heads_of(attn.v_proj, encoded).transpose(0, 1).contiguous())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        ctx = get_forward_context()
        x = decoder.embed_tokens(input_ids) * decoder.embed_scale + decoder.embed_positions(ctx.positions)
        for layer in decoder.layers:
            x = layer(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        return F.linear(decoder.layer_norm(hidden), decoder.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ours = ((name.removeprefix("model."), tensor) for name, tensor in weights
                if name != "proj_out.weight")  # tied to the token embedding
        return copy_named(dict(self.model.named_parameters()), ours)

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()}

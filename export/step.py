"""Mimi's decoder as one streaming step with explicit state (all zero: a fresh stream): key/value rings and
one flat conv state. Window "moshi" equals moshi's streaming decoder, "exact" offline decoding (docs/design.md §3)."""

from __future__ import annotations

import copy
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .spec import DecoderSpec, StateSpec

WINDOWS = ("moshi", "exact")
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Positions are split as hi * ROPE_BLOCK + lo so RoPE angles stay accurate in fp32 for streams of
# many hours (a plain fp32 `position * inv_freq` drifts as the position grows).
ROPE_BLOCK = 1024
# Stride-1 convs with at least this many input channels run as one matmul over the batch.
MATMUL_CONV_CHANNELS = 512


def frozen(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(tensor.detach().to(dtype).clone(), requires_grad=False)


class StreamingConv(nn.Module):
    """Causal stride-1 conv keeping its last (kernel - 1) * dilation inputs. Wide ones run as one matmul over
    the batch: a Conv runs one GEMM per stream, each reading the whole weight for a few samples."""

    def __init__(self, conv: nn.Conv1d, dtype: torch.dtype):
        super().__init__()
        if conv.stride[0] != 1 or conv.padding[0] != 0:
            raise ValueError("streaming conv expects stride 1 and no built-in padding")
        self.bias = None if conv.bias is None else frozen(conv.bias, dtype)
        self.dilation, self.groups, self.kernel = conv.dilation[0], conv.groups, conv.kernel_size[0]
        self.channels, self.out_channels = conv.in_channels, conv.out_channels
        self.context = (self.kernel - 1) * self.dilation
        self.state_shape = (self.channels, self.context)
        self.as_matmul = self.groups == 1 and self.channels >= MATMUL_CONV_CHANNELS
        weight = conv.weight.detach()  # [Cout, Cin, K], as a matmul [Cin * K, Cout]
        self.weight = frozen((weight.flatten(1).t() if self.as_matmul else weight).contiguous(), dtype)

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        if self.context:
            x = torch.cat([state.take(*self.state_shape), x], dim=2)
            state.put(x[:, :, -self.context :])
        if not self.as_matmul:
            return F.conv1d(x, self.weight, self.bias, dilation=self.dilation, groups=self.groups)
        steps = x.shape[2] - self.context
        if self.kernel == 1:
            rows = x.transpose(1, 2).reshape(-1, self.channels)
        else:
            taps = [x[:, :, j * self.dilation : j * self.dilation + steps] for j in range(self.kernel)]
            rows = torch.stack(taps, dim=3).transpose(1, 2).reshape(-1, self.channels * self.kernel)
        y = torch.matmul(rows, self.weight)
        y = y if self.bias is None else y + self.bias
        return y.view(x.shape[0], steps, self.out_channels).transpose(1, 2)


class StreamingConvTranspose(nn.Module):
    """Causal transposed conv, kernel = 2 * stride: block t = taps [0, s) of step t + taps [s, 2s) of step t - 1
    (the state, without bias). Not ConvTranspose: the NGC 24.10 backend's ORT 1.19 runs it stream by stream."""

    def __init__(self, conv: nn.ConvTranspose1d, dtype: torch.dtype):
        super().__init__()
        self.bias = None if conv.bias is None else frozen(conv.bias, dtype)
        self.stride, self.groups = conv.stride[0], conv.groups
        self.in_channels, self.channels = conv.in_channels, conv.out_channels
        if conv.kernel_size[0] != 2 * self.stride or self.groups not in (1, self.channels):
            raise ValueError("streaming transposed conv expects kernel = 2 * stride, plain or depthwise")
        weight = conv.weight.detach()  # [Cin, Cout / groups, 2s]
        if self.groups == 1:  # [Cin, Cout, s] -> [Cin, s * Cout], tap-major
            self.first, self.second = (frozen(half.permute(0, 2, 1).reshape(self.in_channels, -1).contiguous(), dtype)
                                       for half in weight.split(self.stride, dim=2))
        else:
            self.weight = frozen(weight, dtype)
        # The overlap tail of one stream: [1, s * Cout] (plain) or [1, C, s] (depthwise).
        self.state_shape = (1, self.stride * self.channels) if self.groups == 1 else (1, self.channels, self.stride)

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        batch, steps = x.shape[0], x.shape[2]
        if self.groups == 1:
            # Contiguous rows, so that the whole batch is one GEMM that reads each weight once.
            rows = x.transpose(1, 2).reshape(-1, self.in_channels)
            first, second = (torch.matmul(rows, half).view(batch, steps, -1) for half in (self.first, self.second))
        else:
            # Depthwise (the upsampling, one step per frame): [B, T, C, 1] * [C, 2s], the same halves.
            first, second = (x.transpose(1, 2)[..., None] * self.weight[:, 0]).split(self.stride, dim=-1)
        previous = torch.cat([state.take(*self.state_shape), second[:, :-1]], dim=1)  # [B, T, s * Cout] or [B, T, C, s]
        state.put(second[:, -1:])
        y = first + previous
        y = y.view(batch, -1, self.channels).transpose(1, 2) if self.groups == 1 else y.permute(0, 2, 1, 3).flatten(2)
        return y if self.bias is None else y + self.bias[:, None]


class ConvState:
    """Hands out the flat conv state's pieces in order and collects their updates."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.offset, self.updates = flat, 0, []

    def take(self, *shape: int) -> torch.Tensor:
        size = math.prod(shape)
        piece = self.flat[:, self.offset : self.offset + size].reshape(-1, *shape)
        self.offset += size
        return piece

    def put(self, piece: torch.Tensor) -> None:
        self.updates.append(piece.flatten(1))


class Elu(nn.Module):
    """ELU as relu(x) + alpha * (exp(min(x, 0)) - 1): ONNX Runtime's Relu / Min / Exp beat its Elu on a CPU."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        negative = torch.exp(torch.clamp(x, max=0.0)) - 1.0
        return torch.relu(x) + (negative if self.alpha == 1.0 else self.alpha * negative)


def streaming_layer(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The streaming form of a layer of Mimi's SEANet decoder (ELU as `Elu`, others as they are)."""
    from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiConvTranspose1d, MimiResnetBlock

    if isinstance(layer, MimiConv1d):
        return StreamingConv(layer.conv, dtype)
    if isinstance(layer, MimiConvTranspose1d):
        return StreamingConvTranspose(layer.conv, dtype)
    if isinstance(layer, MimiResnetBlock):
        return SEANetBlock(layer, dtype)
    return Elu(layer.alpha) if isinstance(layer, nn.ELU) else layer


def run_layers(layers, x: torch.Tensor, state: ConvState) -> torch.Tensor:
    for layer in layers:
        x = layer(x, state) if isinstance(layer, (StreamingConv, StreamingConvTranspose, SEANetBlock)) else layer(x)
    return x


class SEANetBlock(nn.Module):
    """Residual block: ELU, conv k3, ELU, conv k1, plus identity (or 1x1 conv) shortcut."""

    def __init__(self, block, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(streaming_layer(layer, dtype) for layer in block.block)
        self.shortcut = streaming_layer(block.shortcut, dtype)

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        return run_layers([self.shortcut], x, state) + run_layers(self.layers, x, state)


class MimiDecoderStep(nn.Module):
    """forward(codes [B, k, F] int32, *caches, conv, position [B, 1] int32)
        -> (pcm [B, 1920 * F] float32, *caches', conv', position'), 1 <= F <= max_frames_per_step."""

    def __init__(self, model, num_codebooks: int = 8, max_frames_per_step: int = 16, window: str = "moshi",
                 kv_cache_dtype: str = "float32", dtype: torch.dtype = torch.float32):
        super().__init__()
        config = model.config
        if window not in WINDOWS:
            raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if not 1 <= num_codebooks <= config.num_quantizers:
            raise ValueError(f"num_codebooks must be in [1, {config.num_quantizers}], got {num_codebooks}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be float32 or float64 (RoPE angles need >= fp32), got {dtype}")
        if (config.num_key_value_heads != config.num_attention_heads or config.hidden_act != "gelu"
                or config.attention_bias or model.decoder.upsample is None):
            raise ValueError("expected Mimi's decoder: learnt upsampling, gelu MLP, attention without bias or GQA")
        self.num_codebooks, self.max_frames_per_step, self.window = num_codebooks, max_frames_per_step, window
        self.kv_cache_dtype, self.dtype = kv_cache_dtype, dtype
        self.codebook_size, self.sample_rate_hz = config.codebook_size, config.sampling_rate
        self.samples_per_frame = int(math.prod(config.upsampling_ratios)) * config.latent_stride
        self.steps_per_frame, self.context = config.latent_stride, config.sliding_window
        self.num_layers, self.hidden_size = config.num_hidden_layers, config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        # Past keys a step needs: offline decoding sees `context` keys including its own; moshi's ring
        # loses the oldest keys to the rest of the frame, so a frame's steps need steps_per_frame - 1 fewer.
        self.cache_len = self.context - (self.steps_per_frame if window == "moshi" else 1)
        # A call's new keys must fit the cache it shifts through (the window covers far fewer frames).
        if not 1 <= max_frames_per_step * self.steps_per_frame <= self.cache_len:
            raise ValueError(f"max_frames_per_step must be in [1, {self.cache_len // self.steps_per_frame}], "
                             f"got {max_frames_per_step}")

        decoder, quantizer = model.decoder, model.quantizer
        constant = functools.partial(self.register_buffer, persistent=False)
        # One [k * codebook_size, hidden] table: each codebook's entries through its output projection.
        n_semantic, tables = quantizer.num_semantic_quantizers, []
        for index in range(num_codebooks):
            rvq, j = ((quantizer.semantic_residual_vector_quantizer, index) if index < n_semantic
                      else (quantizer.acoustic_residual_vector_quantizer, index - n_semantic))
            codebook = rvq.layers[j].codebook
            embed = codebook.embed_sum.double() / codebook.cluster_usage.double().clamp(min=codebook.epsilon)[:, None]
            tables.append(embed if rvq.output_proj is None else embed @ rvq.output_proj.weight.double()[:, :, 0].T)
        constant("codebook_table", torch.cat(tables).detach().to(dtype))
        constant("codebook_offsets",
                 (torch.arange(num_codebooks, dtype=torch.int32) * self.codebook_size).view(1, num_codebooks, 1))
        self.upsample = StreamingConvTranspose(decoder.upsample.conv, dtype)

        self.layers = nn.ModuleList()
        for layer in decoder.decoder_transformer.layers:
            attn = layer.self_attn
            block = nn.Module()
            block.norm1 = copy.deepcopy(layer.input_layernorm).to(dtype).requires_grad_(False)
            block.norm2 = copy.deepcopy(layer.post_attention_layernorm).to(dtype).requires_grad_(False)
            # The attention scale 1 / sqrt(head_dim) is folded into the query projection (RoPE is linear).
            block.qkv = frozen(torch.cat([attn.q_proj.weight / math.sqrt(config.head_dim), attn.k_proj.weight,
                                          attn.v_proj.weight]), dtype)
            block.out = frozen(attn.o_proj.weight, dtype)
            block.fc1, block.fc2 = frozen(layer.mlp.fc1.weight, dtype), frozen(layer.mlp.fc2.weight, dtype)
            block.scale1, block.scale2 = (frozen(scale.scale, dtype)
                                          for scale in (layer.self_attn_layer_scale, layer.mlp_layer_scale))
            self.layers.append(block)

        rope = config.rope_parameters or {}
        theta = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        constant("rope_inv_freq", inv_freq.to(dtype))
        constant("rope_block_angle", torch.remainder(inv_freq * ROPE_BLOCK, 2 * math.pi).to(dtype))
        half = self.head_dim // 2
        constant("rope_sign", torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype))
        constant("rope_swap", torch.cat([torch.arange(half, 2 * half), torch.arange(half)]))

        self.seanet = nn.ModuleList(streaming_layer(layer, dtype) for layer in decoder.decoder_seanet.layers)

        # The window of the largest call; a call of T steps uses the first T entries. window_lower[t]: the
        # oldest key new step t may attend, as an offset from the call's first step; attn_allowed[t, j]:
        # new step t may attend new step j of the same call.
        t = torch.arange(self.steps_per_frame * max_frames_per_step)
        lower = t - (self.context - 1)
        if window == "moshi":  # the ring holds the last `context` steps up to the end of the step's frame
            lower = lower + (self.steps_per_frame - 1 - t % self.steps_per_frame)
        constant("window_lower", lower.to(torch.int32))
        constant("attn_allowed", (t[None] <= t[:, None]) & (t[None] >= lower[:, None]))
        # Each streaming conv takes its piece of the conv state once per call.
        self.conv_state_size = sum(math.prod(module.state_shape) for module in self.modules()
                                   if isinstance(module, (StreamingConv, StreamingConvTranspose)))

    def spec(self) -> DecoderSpec:
        cache_shape = (self.num_heads, self.cache_len, self.head_dim)
        states = [(f"layer{layer}_{kind}", self.kv_cache_dtype, cache_shape)
                  for layer in range(self.num_layers) for kind in ("keys", "values")]
        states += [("conv", "float32", (self.conv_state_size,)), ("position", "int32", (1,))]
        return DecoderSpec(
            num_codebooks=self.num_codebooks, codebook_size=self.codebook_size,
            max_frames_per_step=self.max_frames_per_step, samples_per_frame=self.samples_per_frame,
            sample_rate_hz=self.sample_rate_hz, window=self.window, kv_cache_dtype=self.kv_cache_dtype,
            states=tuple(StateSpec(f"state_in_{index:02d}_{name}", f"state_out_{index:02d}_{name}", dtype, shape)
                         for index, (name, dtype, shape) in enumerate(states)),
        )

    def zero_state(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Every state tensor of a fresh stream, in the spec's order (caches in self.dtype where it is float64)."""
        cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] if self.dtype == torch.float32 else self.dtype
        dtypes = {"int32": torch.int32, "float32": self.dtype, self.kv_cache_dtype: cache_dtype}
        return tuple(torch.zeros(batch_size, *s.shape, dtype=dtypes[s.dtype]) for s in self.spec().states)

    def forward(self, codes, *state):
        *caches, conv, position = state
        conv_state = ConvState(conv)
        # [B, k, F] -> [B, hidden, F]: sum of the k folded codebook embeddings.
        latent = self.codebook_table[codes + self.codebook_offsets].sum(dim=1).transpose(1, 2)
        x = self.upsample(latent, conv_state)
        x, caches = self._transformer(x.transpose(1, 2), caches, position)
        pcm = run_layers(self.seanet, x.transpose(1, 2), conv_state)
        new_conv = torch.cat(conv_state.updates, dim=1)
        return (pcm.flatten(1).float(), *caches, new_conv, position + codes.shape[2] * self.steps_per_frame)

    def _rope(self, position, steps):
        """cos, sin [B, 1, T, head_dim] for positions position + [0, T); sin carries the sign of the
        rotation, so rotating x is x * cos + x[..., rope_swap] * sin (its halves swapped)."""
        positions = position + torch.arange(steps, dtype=torch.int32, device=position.device).view(1, -1)
        block = torch.div(positions, ROPE_BLOCK, rounding_mode="trunc")
        within = positions - block * ROPE_BLOCK
        angles = block.to(self.dtype)[..., None] * self.rope_block_angle + within.to(self.dtype)[..., None] * self.rope_inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin() * self.rope_sign

    def _transformer(self, x, caches, position):
        batch, steps, hidden = x.shape[0], x.shape[1], self.hidden_size
        heads, head_dim, n = self.num_heads, self.head_dim, self.cache_len
        cos, sin = self._rope(position, steps)
        # Ring slot s holds the latest step before `position` that is congruent to s (negative: none
        # yet); the operand of remainder is never negative.
        slot = torch.arange(n, dtype=torch.int32, device=x.device).view(1, -1)
        held = position - 1 - torch.remainder(position - 1 - slot + n, n)  # [B, n]
        lower = self.window_lower[:steps].view(1, 1, -1, 1)  # [1, 1, T, 1]: oldest key offset step t sees
        allowed_past = ((held - position)[:, None, None, :] >= lower) & (held >= 0)[:, None, None, :]
        zero = torch.zeros((), dtype=self.dtype, device=x.device)
        blocked = torch.full((), -math.inf, dtype=self.dtype, device=x.device)
        bias_past = torch.where(allowed_past, zero, blocked)  # [B, 1, T, n]
        bias_new = torch.where(self.attn_allowed[:steps, :steps], zero, blocked)  # [T, T]
        write = self._write_index(position, batch, steps)
        cache_dtype = caches[0].dtype
        new_caches = []
        for index, block in enumerate(self.layers):
            past_k, past_v = caches[2 * index], caches[2 * index + 1]
            h = F.layer_norm(x, (hidden,), block.norm1.weight, block.norm1.bias, block.norm1.eps)
            # [B, T, 3 * H * D] -> [B, 3H, T, D]: queries and keys get RoPE together, then part.
            qkv = F.linear(h, block.qkv).view(batch, steps, 3 * heads, head_dim).transpose(1, 2)
            qk, v = qkv.split([2 * heads, heads], dim=1)
            qk = qk * cos + qk.index_select(3, self.rope_swap) * sin
            q, k = qk.split(heads, dim=1)
            k, v = k.to(cache_dtype), v.to(cache_dtype)
            new_caches += [_WriteSlots.apply(past_k, write, k), _WriteSlots.apply(past_v, write, v)]
            if cache_dtype != self.dtype:
                # Attend over what the cache holds, so F frames per call equal F calls of one frame.
                k, v, past_k, past_v = (t.to(self.dtype) for t in (k, v, past_k, past_v))
            # Scores against the ring and against the new steps separately: no copy of the cache.
            scores = torch.cat([torch.matmul(q, past_k.transpose(2, 3)) + bias_past,
                                torch.matmul(q, k.transpose(2, 3)) + bias_new], dim=-1)
            weights_past, weights_new = torch.softmax(scores, dim=-1).split([n, steps], dim=-1)
            attn = torch.matmul(weights_past, past_v) + torch.matmul(weights_new, v)
            attn = attn.transpose(1, 2).reshape(batch, steps, hidden)
            x = x + block.scale1 * F.linear(attn, block.out)
            h = F.layer_norm(x, (hidden,), block.norm2.weight, block.norm2.bias, block.norm2.eps)
            x = x + block.scale2 * F.linear(F.gelu(F.linear(h, block.fc1)), block.fc2)
        return x, new_caches

    def _write_index(self, position, batch: int, steps: int):
        """[B, H, T, 3] (row, head, slot): where the call's steps go in every cache, slot (position + t) % n."""
        shape = (batch, self.num_heads, steps)
        ahead = torch.arange(steps, dtype=torch.int32, device=position.device).view(1, -1)
        slots = torch.remainder(position + ahead, self.cache_len).long()[:, None, :].expand(shape)
        rows = torch.arange(batch, device=position.device).view(-1, 1, 1).expand(shape)
        heads = torch.arange(self.num_heads, device=position.device).view(1, -1, 1).expand(shape)
        return torch.stack([rows, heads, slots], dim=-1)


class _WriteSlots(torch.autograd.Function):
    """cache with cache[index[..., :3]] = new: the ONNX ScatterND, exported as one node over an index
    built once per call (torch's index_put exports its own index plumbing at every use)."""

    @staticmethod
    def forward(ctx, cache, index, new):
        return cache.index_put(tuple(index.unbind(-1)), new)

    @staticmethod
    def symbolic(g, cache, index, new):
        return g.op("ScatterND", cache, index, new)


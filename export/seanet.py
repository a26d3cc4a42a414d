"""The streaming convolutions of Mimi's SEANet decoder, as `MimiDecoderStep` runs them: each conv keeps
its left context, and each transposed conv its overlap tail, in the step's flat conv state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Stride-1 convs with at least this many input channels run as one matmul over the batch.
MATMUL_CONV_CHANNELS = 512


def frozen(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """A detached copy of `tensor` in `dtype`, as a parameter without gradient."""
    return nn.Parameter(tensor.detach().to(dtype).clone(), requires_grad=False)


class StreamingConv(nn.Module):
    """Causal stride-1 conv; its state is the last (kernel - 1) * dilation input samples. Convs of
    >= MATMUL_CONV_CHANNELS inputs run as one matmul over the batch, [B * T, Cin * K] @ [Cin * K, Cout]:
    a Conv runs one GEMM per stream, each reading the whole weight (15 MB for the first) for a few samples."""

    def __init__(self, conv: nn.Conv1d, dtype: torch.dtype):
        super().__init__()
        if conv.stride[0] != 1 or conv.padding[0] != 0:
            raise ValueError("streaming conv expects stride 1 and no built-in padding")
        self.bias = None if conv.bias is None else frozen(conv.bias, dtype)
        self.dilation = conv.dilation[0]
        self.groups = conv.groups
        self.kernel = conv.kernel_size[0]
        self.context = (self.kernel - 1) * self.dilation
        self.channels = conv.in_channels
        self.out_channels = conv.out_channels
        self.as_matmul = self.groups == 1 and self.channels >= MATMUL_CONV_CHANNELS
        weight = conv.weight.detach().to(dtype)
        if self.as_matmul:  # [Cout, Cin, K] -> [Cin * K, Cout]
            weight = weight.flatten(1).t()
        self.weight = frozen(weight.contiguous(), dtype)

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        if self.context:
            x = torch.cat([state.take(self.channels, self.context), x], dim=2)
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
        if self.bias is not None:
            y = y + self.bias
        return y.view(x.shape[0], steps, self.out_channels).transpose(1, 2)


class StreamingConvTranspose(nn.Module):
    """Causal transposed conv with kernel = 2 * stride; its state is the overlap tail, without bias.
    Output block t = taps [0, s) of input step t + taps [s, 2s) of step t - 1 (the state for t = 0),
    each half one matmul over the whole batch, [B * T, Cin] @ [Cin, s * Cout], tap-major columns so
    the sum is already [B, T * s, Cout]. Not ConvTranspose: ONNX Runtime 1.19's (the NGC 24.10
    native backend's) computes stream by stream and is several times slower on these inputs."""

    def __init__(self, conv: nn.ConvTranspose1d, dtype: torch.dtype):
        super().__init__()
        weight = conv.weight.detach().to(dtype)  # [Cin, Cout / groups, 2s]
        self.bias = None if conv.bias is None else frozen(conv.bias, dtype)
        self.stride = conv.stride[0]
        self.groups = conv.groups
        self.in_channels = conv.in_channels
        self.channels = conv.out_channels
        if conv.kernel_size[0] != 2 * self.stride or self.groups not in (1, self.channels):
            raise ValueError("streaming transposed conv expects kernel = 2 * stride, plain or depthwise")
        if self.groups == 1:  # [Cin, Cout, s] -> [Cin, s * Cout], tap-major
            halves = weight.split(self.stride, dim=2)
            self.first, self.second = (frozen(h.permute(0, 2, 1).reshape(self.in_channels, -1).contiguous(), dtype)
                                       for h in halves)
        else:
            self.weight = frozen(weight, dtype)

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        stride, channels = self.stride, self.channels
        if self.groups == 1:
            # Contiguous rows, so that the whole batch is one GEMM that reads each weight once.
            rows = x.transpose(1, 2).reshape(-1, self.in_channels)
            first = torch.matmul(rows, self.first).view(x.shape[0], x.shape[2], stride * channels)
            second = torch.matmul(rows, self.second).view(x.shape[0], x.shape[2], stride * channels)
            previous = torch.cat([state.take(1, stride * channels), second[:, :-1]], dim=1)  # [B, T, s * Cout]
            state.put(second[:, -1:])
            y = (first + previous).view(x.shape[0], -1, channels)  # [B, T * s, Cout]
            if self.bias is not None:
                y = y + self.bias
            return y.transpose(1, 2)
        # Depthwise (the upsampling, one step per frame): [B, T, C, 1] * [C, 2s], the same halves.
        cols = x.transpose(1, 2)[..., None] * self.weight[:, 0]
        first, second = cols.split(stride, dim=-1)
        previous = torch.cat([state.take(channels, stride)[:, None], second[:, :-1]], dim=1)  # [B, T, C, s]
        state.put(second[:, -1])
        y = (first + previous).permute(0, 2, 1, 3).flatten(2)
        if self.bias is not None:
            y = y + self.bias[None, :, None]
        return y


class ConvState:
    """Reads conv state pieces from the flat state tensor in order and collects their updates."""

    def __init__(self, flat: torch.Tensor | None, dtype: torch.dtype = torch.float32):
        self.flat = flat
        self.dtype = dtype
        self.offset = 0
        self.updates: list[torch.Tensor] = []
        self.pieces: list[tuple[int, int]] = []

    def take(self, channels: int, length: int) -> torch.Tensor:
        size = channels * length
        self.pieces.append((channels, length))
        if self.flat is None:  # layout discovery
            return torch.zeros(1, channels, length, dtype=self.dtype)
        piece = self.flat[:, self.offset : self.offset + size].reshape(-1, channels, length)
        self.offset += size
        return piece

    def put(self, piece: torch.Tensor) -> None:
        self.updates.append(piece.flatten(1))


class Elu(nn.Module):
    """ELU as relu(x) + alpha * (exp(min(x, 0)) - 1): the same values (within an ulp), run by ONNX
    Runtime's vectorised Relu / Min / Exp kernels, which are faster on a CPU than its Elu kernel."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        negative = torch.exp(torch.clamp(x, max=0.0)) - 1.0
        return torch.relu(x) + (negative if self.alpha == 1.0 else self.alpha * negative)


def plain_layer(layer: nn.Module) -> nn.Module:
    return Elu(layer.alpha) if isinstance(layer, nn.ELU) else layer


class SEANetBlock(nn.Module):
    """Residual block: ELU, conv k3, ELU, conv k1, plus identity (or 1x1 conv) shortcut."""

    def __init__(self, block, dtype: torch.dtype):
        super().__init__()
        from transformers.models.mimi.modeling_mimi import MimiConv1d

        self.layers = nn.ModuleList(
            [StreamingConv(layer.conv, dtype) if isinstance(layer, MimiConv1d) else plain_layer(layer)
             for layer in block.block]
        )
        self.shortcut = StreamingConv(block.shortcut.conv, dtype) if isinstance(block.shortcut, MimiConv1d) else None

    def forward(self, x: torch.Tensor, state: ConvState) -> torch.Tensor:
        residual = x if self.shortcut is None else self.shortcut(x, state)
        for layer in self.layers:
            x = layer(x, state) if isinstance(layer, StreamingConv) else layer(x)
        return residual + x

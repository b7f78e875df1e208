"""The benchmark networks, twice: as PyTorch modules (exported with torch.onnx.export) and as
plain onnx.helper graphs of the same structure, so the benchmark also runs without torch.

Every model takes its data inputs and returns one scalar loss (mean cross-entropy).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20  # Gelu is a standard operator from opset 20


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int = 1
    d_model: int = 256
    heads: int = 8
    seq: int = 64
    vocab: int = 512
    batch: int = 8


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    batch: int = 64
    channels: int = 16
    classes: int = 10


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    batch: int = 64
    sizes: tuple[int, ...] = (784, 256, 10)


def inputs_of(config, seed: int = 1) -> dict[str, np.ndarray]:
    """One batch of data for the model: named like the exported graph's inputs."""
    rng = np.random.default_rng(seed)
    if isinstance(config, GPTConfig):
        shape = (config.batch, config.seq)
        return {"tok": rng.integers(0, config.vocab, shape).astype(np.int64),
                "tgt": rng.integers(0, config.vocab, shape).astype(np.int64)}
    if isinstance(config, CNNConfig):
        return {"x": rng.standard_normal((config.batch, 1, 28, 28)).astype(np.float32),
                "tgt": rng.integers(0, config.classes, config.batch).astype(np.int64)}
    return {"x": rng.standard_normal((config.batch, config.sizes[0])).astype(np.float32),
            "tgt": rng.integers(0, config.sizes[-1], config.batch).astype(np.int64)}


# PyTorch modules ------------------------------------------------------------------------------


def torch_module(config, seed: int = 0):
    """The PyTorch network for ``config`` (imports torch lazily)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, c: GPTConfig):
            super().__init__()
            d = c.d_model
            self.heads = c.heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.register_buffer("causal", torch.tril(torch.ones(c.seq, c.seq, dtype=torch.bool)))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
            y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, c: GPTConfig):
            super().__init__()
            self.tok = nn.Embedding(c.vocab, c.d_model)
            self.pos = nn.Parameter(torch.randn(c.seq, c.d_model) * 0.02)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
            self.ln = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab)

        def forward(self, tok, tgt):
            x = self.tok(tok) + self.pos[: tok.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    class CNN(nn.Module):
        def __init__(self, c: CNNConfig):
            super().__init__()
            ch = c.channels
            self.conv1, self.bn1 = nn.Conv2d(1, ch, 3, padding=1), nn.BatchNorm2d(ch)
            self.conv2, self.bn2 = nn.Conv2d(ch, 2 * ch, 3, padding=1), nn.BatchNorm2d(2 * ch)
            self.fc = nn.Linear(2 * ch * 7 * 7, c.classes)

        def forward(self, x, tgt):
            x = F.max_pool2d(F.leaky_relu(self.bn1(self.conv1(x)), 0.1), 2)
            x = F.avg_pool2d(F.leaky_relu(self.bn2(self.conv2(x)), 0.1), 2)
            return F.cross_entropy(self.fc(x.flatten(1)), tgt)

    class MLP(nn.Module):
        def __init__(self, c: MLPConfig):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(c.sizes[:-1], c.sizes[1:]))

        def forward(self, x, tgt):
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
            return F.cross_entropy(x, tgt)

    torch.manual_seed(seed)
    module = {GPTConfig: GPT, CNNConfig: CNN, MLPConfig: MLP}[type(config)](config)
    # Eval mode: BatchNormalization uses its running statistics, as the exported graph does.
    return module.eval()


def export(module, inputs: dict[str, np.ndarray], optimize: bool = True) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True, optimize=...) of ``module`` applied to ``inputs``."""
    import warnings

    import torch

    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, optimize=optimize, verbose=False,
                                    input_names=list(inputs), opset_version=OPSET)
    return program.model_proto


# The same networks with onnx.helper ---------------------------------------------------------


class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, *shape: int, scale: float | None = None) -> str:
        scale = 1 / np.sqrt(shape[0]) if scale is None else scale
        return self.init(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def __call__(self, op: str, *inputs: str, outputs: int = 1, **attrs):
        names = [f"{op.lower()}{len(self.nodes)}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, name=f"{op}_{len(self.nodes)}",
                                           **attrs))
        return names[0] if outputs == 1 else names

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], loss: str) -> onnx.ModelProto:
        self.nodes[-1].output[0] = "loss"
        graph = helper.make_graph(self.nodes, name, inputs,
                                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                                  self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _cross_entropy(g: _Graph, logits: str, tgt: str) -> str:
    return g("SoftmaxCrossEntropyLoss", logits, tgt, reduction="mean")


def helper_model(config, seed: int = 0) -> onnx.ModelProto:
    """The network for ``config`` built with onnx.helper (random weights, no torch needed)."""
    g = _Graph(seed)
    if isinstance(config, GPTConfig):
        return _gpt(g, config)
    if isinstance(config, CNNConfig):
        return _cnn(g, config)
    return _mlp(g, config)


def _gpt(g: _Graph, c: GPTConfig) -> onnx.ModelProto:
    d, h = c.d_model, c.heads
    ones, zeros = g.init("ones", np.ones(d, np.float32)), g.init("zeros", np.zeros(d, np.float32))
    split = g.init("qkv_split", np.array([d, d, d], np.int64))
    heads_shape = g.init("heads_shape", np.array([c.batch, c.seq, h, d // h], np.int64))
    merged_shape = g.init("merged_shape", np.array([c.batch, c.seq, d], np.int64))
    flat_shape = g.init("flat_shape", np.array([-1, c.vocab], np.int64))
    flat_tgt = g.init("flat_tgt", np.array([-1], np.int64))
    scale = g.init("scale", np.array((d // h) ** -0.5, np.float32))
    mask = g.init("mask", np.tril(np.ones((c.seq, c.seq), bool)))
    minus_inf = g.init("minus_inf", np.array(-np.inf, np.float32))

    def linear(x, name, fan_in, fan_out):
        w = g.weight(name + "_w", fan_in, fan_out)
        return g("Add", g("MatMul", x, w), g.init(name + "_b", np.zeros(fan_out, np.float32)))

    x = g("Add", g("Gather", g.weight("tok_emb", c.vocab, d, scale=1.0), "tok"),
          g.weight("pos_emb", c.seq, d, scale=0.02))
    for i in range(c.layers):
        p = f"h{i}_"
        qkv = linear(g("LayerNormalization", x, ones, zeros, axis=-1), p + "qkv", d, 3 * d)
        # K goes straight to (batch, heads, dk, seq), one Transpose as the exporter emits it.
        q, k, v = (g("Transpose", g("Reshape", z, heads_shape), perm=perm)
                   for z, perm in zip(g("Split", qkv, split, axis=-1, outputs=3),
                                      ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])))
        scores = g("Mul", g("MatMul", q, k), scale)
        attn = g("Softmax", g("Where", mask, scores, minus_inf), axis=-1)
        y = g("Reshape", g("Transpose", g("MatMul", attn, v), perm=[0, 2, 1, 3]), merged_shape)
        x = g("Add", x, linear(y, p + "proj", d, d))
        up = g("Gelu", linear(g("LayerNormalization", x, ones, zeros, axis=-1), p + "fc", d, 4 * d))
        x = g("Add", x, linear(up, p + "out", 4 * d, d))
    logits = linear(g("LayerNormalization", x, ones, zeros, axis=-1), "head", d, c.vocab)
    _cross_entropy(g, g("Reshape", logits, flat_shape), g("Reshape", "tgt", flat_tgt))
    shape = [c.batch, c.seq]
    return g.model("gpt", [helper.make_tensor_value_info("tok", TensorProto.INT64, shape),
                           helper.make_tensor_value_info("tgt", TensorProto.INT64, shape)], "loss")


def _cnn(g: _Graph, c: CNNConfig) -> onnx.ModelProto:
    def conv_bn(x, name, cin, cout):
        w = g.weight(name + "_w", cout, cin, 3, 3, scale=1 / np.sqrt(9 * cin))
        y = g("Conv", x, w, g.init(name + "_b", np.zeros(cout, np.float32)), pads=[1, 1, 1, 1])
        bn = [g.init(name + "_bn_" + k, np.full(cout, v, np.float32))
              for k, v in (("scale", 1.0), ("bias", 0.0), ("mean", 0.0), ("var", 1.0))]
        return g("LeakyRelu", g("BatchNormalization", y, *bn), alpha=0.1)

    ch = c.channels
    x = g("MaxPool", conv_bn("x", "conv1", 1, ch), kernel_shape=[2, 2], strides=[2, 2])
    x = g("AveragePool", conv_bn(x, "conv2", ch, 2 * ch), kernel_shape=[2, 2], strides=[2, 2])
    x = g("Flatten", x, axis=1)
    logits = g("Gemm", x, g.weight("fc_w", c.classes, 2 * ch * 49, scale=1 / np.sqrt(2 * ch * 49)),
               g.init("fc_b", np.zeros(c.classes, np.float32)), transB=1)
    _cross_entropy(g, logits, "tgt")
    return g.model("cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [c.batch, 1, 28, 28]),
                           helper.make_tensor_value_info("tgt", TensorProto.INT64, [c.batch])], "loss")


def _mlp(g: _Graph, c: MLPConfig) -> onnx.ModelProto:
    x = "x"
    for i, (a, b) in enumerate(zip(c.sizes[:-1], c.sizes[1:])):
        x = g("Gemm", x, g.weight(f"fc{i}_w", b, a, scale=1 / np.sqrt(a)),
              g.init(f"fc{i}_b", np.zeros(b, np.float32)), transB=1)
        if i < len(c.sizes) - 2:
            x = g("Relu", x)
    _cross_entropy(g, x, "tgt")
    return g.model("mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [c.batch, c.sizes[0]]),
                           helper.make_tensor_value_info("tgt", TensorProto.INT64, [c.batch])], "loss")

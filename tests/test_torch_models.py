"""Models exported by torch.onnx.export(dynamo=True), differentiated by the CLI, against torch autograd."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x, target):
        logits = self.l2(torch.relu(self.l1(x)))
        return torch.nn.functional.cross_entropy(logits, target)


def export(module, args, path, dynamic_shapes=None, optimize=True):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, optimize=optimize,
                                    dynamic_shapes=dynamic_shapes, verbose=False)
    program.save(str(path))
    return path


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    torch.manual_seed(0)
    module = MLP().eval()
    folder = tmp_path_factory.mktemp("mlp")
    batch = torch.export.Dim("batch")
    x, t = torch.randn(5, 8), torch.randint(0, 4, (5,))
    forward = export(module, (x, t), folder / "mlp.onnx", dynamic_shapes=({0: batch}, {0: batch}))
    backward = folder / "mlp_grad.onnx"
    assert main(["grad", str(forward), "-o", str(backward)]) == 0
    return module, forward, backward


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_mlp_cross_entropy_matches_torch_autograd(mlp_files, batch):
    module, forward, backward = mlp_files
    model = onnx.load(str(backward))
    names = {p.name: p for p in onnx.load(str(forward)).graph.initializer}
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 8, generator=generator)
    t = torch.randint(0, 4, (batch,), generator=generator)
    module.zero_grad()
    loss = module(x, t)
    loss.backward()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in model.graph.input]
    outputs = session.run(None, dict(zip(inputs, [x.numpy(), t.numpy()])))
    results = dict(zip([o.name for o in model.graph.output], outputs))
    np.testing.assert_allclose(results[model.graph.output[0].name], loss.item(), rtol=1e-5)
    checked = 0
    for name, parameter in module.named_parameters():
        if name in names:
            expected = parameter.grad.numpy()
            got = results[f"grad_{name}"]
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(expected).max()))
            checked += 1
    assert checked == 4


def torch_gradients_match(module, args, tmp_path, dynamic_shapes=None, rtol=1e-4, atol=1e-5):
    """Export ``module`` (returning a scalar loss), differentiate with the CLI, compare all grads.

    Exported with optimize=False: the optimiser ties equal initializers and folds weight.T into
    new ones, after which the graph's parameters are no longer the module's.
    """
    forward = export(module, args, tmp_path / "model.onnx", dynamic_shapes=dynamic_shapes, optimize=False)
    backward = tmp_path / "grad.onnx"
    assert main(["grad", str(forward), "-o", str(backward)]) == 0
    model = onnx.load(str(backward))
    exported = {t.name for t in onnx.load(str(forward)).graph.initializer}
    module.zero_grad()
    loss = module(*args)
    loss.backward()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    results = dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))
    np.testing.assert_allclose(results[model.graph.output[0].name], loss.item(), rtol=1e-5)
    checked = 0
    for name, parameter in module.named_parameters():
        if name in exported and parameter.grad is not None:
            expected = parameter.grad.numpy()
            np.testing.assert_allclose(results[f"grad_{name}"], expected, rtol=rtol,
                                       atol=atol * max(1.0, float(np.abs(expected).max())), err_msg=name)
            checked += 1
    return checked


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, groups=4)
        self.fc = torch.nn.Linear(8 * 1 * 1, 5)

    def forward(self, x, target):
        h = torch.nn.functional.leaky_relu(self.bn(self.conv1(x)), 0.1)
        h = torch.nn.functional.max_pool2d(h, 2)
        h = torch.nn.functional.avg_pool2d(self.conv2(h), 1)
        h = torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        return torch.nn.functional.cross_entropy(self.fc(h), target)


def test_small_cnn_matches_torch_autograd(tmp_path):
    torch.manual_seed(1)
    module = SmallCNN().eval()
    args = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    assert torch_gradients_match(module, args, tmp_path) >= 6


class DecoderBlock(torch.nn.Module):
    """Embedding, learned positions, LayerNorm, fused QKV, causal softmax attention, GELU MLP, loss."""

    def __init__(self, vocab=11, d=16, heads=2, seq=5):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.1)
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, tokens, targets):
        b, t = tokens.shape
        x = self.embed(tokens) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        shape = (b, t, self.heads, -1)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        scores = torch.where(self.mask[:t, :t], scores, torch.full_like(scores, float("-inf")))
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, -1))
        x = x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_gpt_decoder_block_matches_torch_autograd(tmp_path):
    torch.manual_seed(2)
    module = DecoderBlock().eval()
    args = (torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5)))
    assert torch_gradients_match(module, args, tmp_path) >= 10


class LSTMRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(3, 4, batch_first=True)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x, target):
        h, _ = self.lstm(x)
        return torch.nn.functional.mse_loss(self.out(h[:, -1]), target)


def test_lstm_model_matches_torch_autograd(tmp_path):
    torch.manual_seed(3)
    module = LSTMRegressor().eval()
    args = (torch.randn(2, 5, 3), torch.randn(2, 1))
    assert torch_gradients_match(module, args, tmp_path) >= 4

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


def export(module, args, path, dynamic_shapes=None):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, optimize=True, dynamic_shapes=dynamic_shapes, verbose=False)
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

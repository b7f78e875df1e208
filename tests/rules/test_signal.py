import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError

R = rng(11)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def check(model, feeds, wrt, constants=()):
    """Finite differences, then the backward graph runs on onnxruntime; returns (seed, grads)."""
    result = assert_gradients(model, feeds, wrt)
    for name in wrt:
        assert np.any(result.fd[name] != 0)
    y = _session(model).run(None, feeds)[0]
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    seed = R.standard_normal(y.shape).astype(np.float32)
    outs = _session(proto).run(None, {**feeds, autodiff.seed_name: seed})
    named = dict(zip([o.name for o in proto.graph.output], outs))
    return seed, {x: named[autodiff.gradient_names[x]] for x in wrt}


def set_output_shape(model, dims):
    """onnx infers no output shape here; the pass needs the rank to declare its dy input."""
    shape = model.graph.output[0].type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().CopyFrom(helper.make_tensor_type_proto(1, [d]).tensor_type.shape.dim[0])


def dft_model(x, opset, axis=None, length=None, shapes=None, **attrs):
    """DFT of X; axis and dft_length as constants (an attribute for axis before opset 20)."""
    nodes, inputs = [], ["X", ""]
    if length is not None:
        nodes.append(helper.make_node("Constant", [], ["n"], value=helper.make_tensor("n", 7, [], [length])))
        inputs[1] = "n"
    if opset >= 20 and axis is not None:
        nodes.append(helper.make_node("Constant", [], ["ax"], value=helper.make_tensor("ax", 7, [], [axis])))
        inputs.append("ax")
    elif axis is not None:
        attrs["axis"] = axis
    while inputs[-1] == "":
        inputs.pop()
    nodes.append(helper.make_node("DFT", inputs, ["out0"], **attrs))
    return make_model(nodes, {"X": x}, ["out0"], opset=opset, shapes=shapes)


def torch_dft(torch, x, axis, inverse, onesided, n):
    """The same transform with torch.fft on a float64 tensor in ONNX's [..., 1 or 2] layout."""
    z = torch.view_as_complex(x) if x.shape[-1] == 2 else x[..., 0]
    if not onesided and x.shape[-1] == 1:
        z = torch.complex(z, torch.zeros_like(z))
    if inverse and onesided:
        return torch.fft.irfft(z, n=n, dim=axis).unsqueeze(-1)
    if onesided:
        y = torch.fft.rfft(z, n=n, dim=axis)
    else:
        y = (torch.fft.ifft if inverse else torch.fft.fft)(z, n=n, dim=axis)
    return torch.view_as_real(y)


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize(
    "shape,axis,inverse,onesided,length",
    [
        ((2, 8, 1), 1, 0, 0, None),  # real input, full spectrum
        ((2, 8, 2), 1, 0, 0, None),  # complex
        ((2, 8, 2), 1, 1, 0, None),  # inverse
        ((2, 8, 1), 1, 1, 0, None),  # inverse of a real input
        ((2, 8, 1), 1, 0, 1, None),  # RFFT, even length
        ((2, 7, 1), 1, 0, 1, None),  # RFFT, odd length
        ((2, 6, 2), 1, 0, 0, 8),  # zero-padded to dft_length
        ((2, 8, 2), 1, 1, 0, 4),  # truncated to dft_length
        ((2, 6, 1), 1, 0, 1, 8),  # RFFT of a padded signal
        ((2, 8, 1), 1, 0, 1, 5),  # RFFT of a truncated signal
        ((3, 2, 4, 2), 2, 0, 0, None),  # inner axis
        ((3, 4, 2, 2), -3, 1, 0, None),  # negative axis
        ((4, 3, 2), 0, 0, 0, None),  # the first axis
        ((2, 5, 2), 1, 1, 1, None),  # IRFFT, default length 2·(5-1)
        ((2, 5, 2), 1, 1, 1, 9),  # IRFFT, odd length
    ],
)
def test_dft(opset, shape, axis, inverse, onesided, length):
    x = f32(*shape)
    model = dft_model(x, opset, axis=axis, length=length, inverse=inverse, onesided=onesided)
    seed, grads = check(model, {"X": x}, ["X"])
    torch = pytest.importorskip("torch")
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch_dft(torch, t, shapes_axis(axis, len(shape)), inverse, onesided, length)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    np.testing.assert_allclose(grads["X"], t.grad.numpy(), rtol=1e-4, atol=1e-4)


def shapes_axis(axis, rank):
    return axis if axis >= 0 else axis + rank


def test_dft_default_axis():
    """Opset 17 defaults to axis 1, opset 20 to axis -2."""
    x = f32(2, 3, 4, 2)
    for opset in (17, 20):
        check(dft_model(x, opset), {"X": x}, ["X"])


def test_dft_symbolic_batch():
    x = f32(3, 8, 1)
    model = dft_model(x, 20, axis=1, shapes={"X": ["N", 8, 1]}, onesided=1)
    check(model, {"X": x}, ["X"])


def test_dft_run_time_length():
    """dft_length fed at run time (not a constant): slice and pad amounts computed in the graph."""
    x = f32(2, 6, 2)
    node = helper.make_node("DFT", ["X", "n"], ["out0"], axis=1)
    for n in (4, 8):
        model = make_model([node], {"X": x, "n": np.array(n, np.int64)}, ["out0"], opset=17)
        set_output_shape(model, [2, "n", 2])
        # Finite differences cannot see the output shape, so compare with torch only.
        torch = pytest.importorskip("torch")
        proto, autodiff = backward_model(model, "out0", ["X"], seed="input")
        seed = f32(2, n, 2)
        grad = _session(proto).run([autodiff.gradient_names["X"]],
                                   {"X": x, "n": np.array(n, np.int64), autodiff.seed_name: seed})[0]
        t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        torch_dft(torch, t, 1, 0, 0, n).backward(torch.tensor(seed, dtype=torch.float64))
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_irfft_unsupported_length_is_refused():
    x = f32(2, 5, 2)
    model = dft_model(x, 20, axis=1, length=4, inverse=1, onesided=1)
    with pytest.raises(RuleError, match="IRFFT"):
        backward_model(model, "out0", ["X"], seed="input")


# STFT

def stft_model(signal, step, window=None, frame_length=None, shapes=None, **attrs):
    nodes = [helper.make_node("Constant", [], ["step"], value=helper.make_tensor("s", 7, [], [step]))]
    inputs = ["signal", "step", "", ""]
    feeds = {"signal": signal}
    if window is not None:
        inputs[2] = "window"
        feeds["window"] = window
    if frame_length is not None:
        nodes.append(helper.make_node("Constant", [], ["fl"], value=helper.make_tensor("fl", 7, [], [frame_length])))
        inputs[3] = "fl"
    while inputs[-1] == "":
        inputs.pop()
    nodes.append(helper.make_node("STFT", inputs, ["out0"], **attrs))
    return make_model(nodes, feeds, ["out0"], opset=17, shapes=shapes), feeds


def torch_stft(torch, x, step, window, M, onesided):
    z = torch.view_as_complex(x) if x.shape[-1] == 2 else x[..., 0]
    frames = z.unfold(1, M, step)  # [B, F, M]
    if window is not None:
        frames = frames * window
    y = torch.fft.rfft(frames, dim=-1) if onesided else torch.fft.fft(frames, dim=-1)
    return torch.view_as_real(y)


@pytest.mark.parametrize(
    "length,channels,step,M,with_window,pass_length,onesided",
    [
        (16, 1, 4, 8, True, False, 1),  # overlapping frames, window gives M
        (17, 1, 3, 8, True, True, 1),  # step does not divide M, a trailing sample unused
        (16, 2, 4, 8, True, False, 0),  # complex signal, full spectrum
        (12, 1, 4, 4, False, True, 1),  # rectangular window, frames touching
        (12, 1, 5, 4, False, True, 0),  # gaps between frames
        (8, 1, 8, 8, False, True, 1),  # one frame
        (15, 1, 2, 7, True, True, 1),  # odd frame length
    ],
)
def test_stft(length, channels, step, M, with_window, pass_length, onesided):
    signal = f32(2, length, channels)
    window = (0.5 + R.random(M)).astype(np.float32) if with_window else None
    model, feeds = stft_model(signal, step, window, M if pass_length else None, onesided=onesided)
    wrt = list(feeds)
    seed, grads = check(model, feeds, wrt)
    torch = pytest.importorskip("torch")
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    y = torch_stft(torch, t["signal"], step, t.get("window"), M or length, onesided)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    for k in wrt:
        np.testing.assert_allclose(grads[k], t[k].grad.numpy(), rtol=1e-4, atol=1e-4)


def test_stft_symbolic_signal():
    signal = f32(2, 16, 1)
    window = (0.5 + R.random(6)).astype(np.float32)
    model, feeds = stft_model(signal, 3, window, shapes={"signal": ["N", "L", 1]})
    set_output_shape(model, ["N", "F", 4, 2])
    check(model, feeds, list(feeds))


def test_stft_run_time_frame_length():
    """frame_length fed at run time: the frame positions and their overlap-add (a scatter-add, the
    count of overlapping frames being unknown) are computed in the graph."""
    signal = f32(2, 16, 1)
    step = helper.make_node("Constant", [], ["step"], value=helper.make_tensor("s", 7, [], [3]))
    node = helper.make_node("STFT", ["signal", "step", "", "fl"], ["out0"])
    torch = pytest.importorskip("torch")
    for M in (4, 7):
        feeds = {"signal": signal, "fl": np.array(M, np.int64)}
        model = make_model([step, node], feeds, ["out0"], opset=17)
        set_output_shape(model, [2, "F", "K", 2])
        proto, autodiff = backward_model(model, "out0", ["signal"], seed="input")
        seed = f32(*_session(model).run(None, feeds)[0].shape)
        grad = _session(proto).run([autodiff.gradient_names["signal"]], {**feeds, autodiff.seed_name: seed})[0]
        t = torch.tensor(signal, dtype=torch.float64, requires_grad=True)
        torch_stft(torch, t, 3, None, M, 1).backward(torch.tensor(seed, dtype=torch.float64))
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_stft_run_time_step_is_refused():
    signal = f32(1, 8, 1)
    node = helper.make_node("STFT", ["signal", "step", "window"], ["out0"])
    model = make_model([node], {"signal": signal, "step": np.array(2, np.int64), "window": np.ones(4, np.float32)},
                       ["out0"], opset=17)
    with pytest.raises(RuleError, match="frame_step"):
        backward_model(model, "out0", ["signal"], seed="input")

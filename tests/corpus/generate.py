"""Generates the corpus: tiny random-weight ONNX models written by the producers people use.

Each producer runs in its own environment; every command writes its ``.onnx`` files here and
records them (with the weights computed by :mod:`catalog`) in ``manifest.json``::

    python tests/corpus/generate.py torch        # main env: TorchScript and dynamo exporters
    python tests/corpus/generate.py onnx         # main env: hand-built (silero-like) and old opsets
    /tmp/venv-tf/bin/python tests/corpus/generate.py tf
    /tmp/venv-paddle/bin/python tests/corpus/generate.py paddle
    /tmp/venv-optimum/bin/python tests/corpus/generate.py optimum
    python tests/corpus/generate.py manifest     # recompute weights and ops of every entry

The environments (see README.md)::

    python -m venv /tmp/venv-tf && /tmp/venv-tf/bin/pip install tensorflow-cpu==2.21.* tf2onnx==1.17.*
    python -m venv /tmp/venv-paddle && /tmp/venv-paddle/bin/pip install "numpy<2" paddlepaddle==2.6.2 paddle2onnx==1.3.1 onnx
    python -m venv --system-site-packages /tmp/venv-optimum && /tmp/venv-optimum/bin/pip install optimum-onnx

Weights are random from fixed seeds; nothing is downloaded (transformers models are built from
configs). A manifest entry says: the file, the producer, the inputs (dtype, how to fill them, a
shape per tested size: two sizes for a model with dynamic axes), the output to scalarise and
train on, the loss, the optimiser and learning rate, the weights and the op multiset.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from catalog import record  # noqa: E402


def entry(file, producer, inputs, output, loss="mse", optimizer="sgd", lr=0.01, note=""):
    """A manifest entry; ``inputs``: (name, dtype, fill, [shape at size 1, shape at size 2])."""
    return {
        "file": file,
        "producer": producer,
        "inputs": [{"name": n, "dtype": d, "fill": f, "shapes": s} for n, d, f, s in inputs],
        "output": output,
        "loss": loss,
        "optimizer": optimizer,
        "lr": lr,
        "note": note,
    }


# --------------------------------------------------------------------------- torch (main env)

def torch_models():
    import torch
    from torch import nn

    class ConvBnAct(nn.Sequential):
        def __init__(self, cin, cout, k=3, s=1):
            super().__init__(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU())

    class Yolo(nn.Module):
        """Backbone of two stride-2 stages, an FPN step (Resize x2, Concat), a head whose box
        branch is a distribution-focal softmax over reg bins (Split, Reshape, Softmax, 1x1 Conv)."""

        def __init__(self, classes=3, reg=8):
            super().__init__()
            self.reg, self.classes = reg, classes
            self.stem = ConvBnAct(3, 8, 3, 2)
            self.stage = ConvBnAct(8, 16, 3, 2)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.fuse = ConvBnAct(24, 16)
            self.head = nn.Conv2d(16, 4 * reg + classes, 1)
            self.dfl = nn.Conv2d(reg, 1, 1, bias=False)
            self.dfl.weight.data[:] = torch.arange(reg, dtype=torch.float32).view(1, reg, 1, 1)
            self.dfl.weight.requires_grad_(False)

        def forward(self, x):
            p3 = self.stem(x)
            p4 = self.stage(p3)
            y = self.fuse(torch.cat([self.up(p4), p3], 1))
            y = self.head(y)
            n = y.shape[0]
            box, cls = y.split([4 * self.reg, self.classes], 1)
            box = box.reshape(n, 4, self.reg, -1).transpose(2, 1).softmax(1)
            box = self.dfl(box).reshape(n, 4, -1)
            return torch.cat([box, cls.reshape(n, self.classes, -1).sigmoid()], 1)

    torch.manual_seed(0)
    yolo = Yolo().eval()
    for m in yolo.modules():  # non-trivial BatchNorm statistics, folded into the convs on export
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    image = torch.randn(1, 3, 32, 32)
    image_shapes = [[1, 3, 32, 32], [2, 3, 48, 40]]
    for opset in (11, 17, 18):
        name = f"torch_yolo_opset{opset}.onnx"
        torch.onnx.export(yolo, (image,), str(HERE / name), dynamo=False, opset_version=opset,
                          input_names=["images"], output_names=["output0"],
                          dynamic_axes={"images": {0: "batch", 2: "height", 3: "width"},
                                        "output0": {0: "batch", 2: "anchors"}})
        record(name[:-5], entry(name, f"torch.onnx.export TorchScript (dynamo=False), opset {opset}",
                                [("images", "float32", "normal", image_shapes)], "output0"))

    class SmallCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            return self.fc(self.features(x).flatten(1))

    class Block(nn.Module):
        """Pre-norm transformer block: LayerNorm, multi-head attention written out, GELU MLP."""

        def __init__(self, d=16, heads=2):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.out = nn.Linear(d, 4)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            x = x + self.mlp(self.ln2(x))
            return self.out(x.mean(1))

    torch.manual_seed(1)
    cnn = SmallCNN().eval()
    for m in cnn.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height", min=8), torch.export.Dim("width", min=8)
    name = "torch_dynamo_cnn.onnx"
    torch.onnx.export(cnn, (torch.randn(2, 3, 32, 32),), str(HERE / name), dynamo=True, input_names=["x"],
                      output_names=["logits"], dynamic_shapes={"x": {0: batch, 2: height, 3: width}}, external_data=False)
    record(name[:-5], entry(name, "torch.onnx.export(dynamo=True), torch.export.Dim batch/height/width",
                            [("x", "float32", "normal", [[2, 3, 32, 32], [3, 3, 24, 40]])], "logits",
                            loss="cross_entropy"))
    torch.manual_seed(2)
    block = Block().eval()
    seq = torch.export.Dim("seq", min=2)
    name = "torch_dynamo_transformer.onnx"
    torch.onnx.export(block, (torch.randn(2, 6, 16),), str(HERE / name), dynamo=True, input_names=["x"],
                      output_names=["logits"], dynamic_shapes={"x": {0: batch, 1: seq}}, external_data=False)
    record(name[:-5], entry(name, "torch.onnx.export(dynamo=True), torch.export.Dim batch/seq",
                            [("x", "float32", "normal", [[2, 6, 16], [3, 9, 16]])], "logits",
                            loss="cross_entropy"))


# --------------------------------------------------------------------------- paddle2onnx

def paddle_models():
    import paddle
    from paddle import nn
    from paddle.static import InputSpec

    globals().update(paddle=paddle, nn=nn)  # dy2static resolves the forwards' names in the module
    paddle.seed(0)

    class ConvBnAct(nn.Layer):
        def __init__(self, cin, cout, k=3, s=1, act=True):
            super().__init__()
            self.conv = nn.Conv2D(cin, cout, k, s, k // 2, bias_attr=False)
            self.bn = nn.BatchNorm2D(cout)
            self.act = nn.Hardswish() if act else None

        def forward(self, x):
            x = self.bn(self.conv(x))
            return self.act(x) if self.act is not None else x

    class SE(nn.Layer):
        def __init__(self, c, r=4):
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2D(1)
            self.reduce = nn.Conv2D(c, c // r, 1)
            self.expand = nn.Conv2D(c // r, c, 1)

        def forward(self, x):
            s = nn.functional.relu(self.reduce(self.pool(x)))
            return x * nn.functional.hardsigmoid(self.expand(s), slope=0.2, offset=0.5)

    class Detector(nn.Layer):
        """PP-OCR DB-like: a MobileNetV3-style stem and SE block, upsample x2, a sigmoid map."""

        def __init__(self):
            super().__init__()
            self.stem = ConvBnAct(3, 16, 3, 2)
            self.block = ConvBnAct(16, 16, 3, 1)
            self.se = SE(16)
            self.head = ConvBnAct(16, 8, 3, 1)
            self.out = nn.Conv2D(8, 1, 3, 1, 1)

        def forward(self, x):
            y = self.se(self.block(self.stem(x)))
            y = nn.functional.interpolate(self.head(y), scale_factor=2, mode="nearest")
            return nn.functional.sigmoid(self.out(y))

    class Recognizer(nn.Layer):
        """PP-OCR CRNN-like: convs that pool H to 1, the width as the sequence, a bidirectional
        LSTM, a linear layer and a softmax over the classes (CTC-style head)."""

        def __init__(self, classes=12):
            super().__init__()
            self.conv1 = ConvBnAct(3, 16, 3, 1)
            self.pool1 = nn.MaxPool2D(2, 2)
            self.conv2 = ConvBnAct(16, 16, 3, 1)
            self.pool2 = nn.AdaptiveAvgPool2D((1, None))
            self.rnn = nn.LSTM(16, 8, direction="bidirect")
            self.fc = nn.Linear(16, classes)

        def forward(self, x):
            y = self.pool2(self.conv2(self.pool1(self.conv1(x))))  # [N, C, 1, W]
            y = paddle.transpose(paddle.squeeze(y, axis=2), [0, 2, 1])  # [N, W, C]
            y, _ = self.rnn(y)
            return nn.functional.softmax(self.fc(y), axis=2)

    def randomise_bn(layer):
        for m in layer.sublayers():
            if isinstance(m, nn.BatchNorm2D):
                m._mean.set_value(paddle.uniform(m._mean.shape, min=-0.5, max=0.5))
                m._variance.set_value(paddle.uniform(m._variance.shape, min=0.5, max=1.5))
        layer.eval()
        return layer

    with tempfile.TemporaryDirectory() as tmp:
        det = randomise_bn(Detector())
        paddle.onnx.export(det, f"{tmp}/det", input_spec=[InputSpec([None, 3, None, None], "float32", "x")],
                           opset_version=11)
        Path(HERE / "paddle_ocr_det.onnx").write_bytes(Path(f"{tmp}/det.onnx").read_bytes())
        rec = randomise_bn(Recognizer())
        paddle.onnx.export(rec, f"{tmp}/rec", input_spec=[InputSpec([None, 3, 8, None], "float32", "x")],
                           opset_version=11)
        Path(HERE / "paddle_ocr_rec.onnx").write_bytes(Path(f"{tmp}/rec.onnx").read_bytes())
    import onnx

    for key, shapes in (("paddle_ocr_det", [[1, 3, 32, 32], [2, 3, 48, 40]]),
                        ("paddle_ocr_rec", [[2, 3, 8, 32], [3, 3, 8, 48]])):
        model = onnx.load(str(HERE / f"{key}.onnx"))
        out = model.graph.output[0].name
        record(key, entry(f"{key}.onnx", "paddle2onnx 1.3.1 (paddle.onnx.export, paddlepaddle 2.6.2), opset_version=11 "
                          "(raised to 14 by paddle2onnx for HardSwish)",
                          [(model.graph.input[0].name, "float32", "normal", shapes)], out))


# --------------------------------------------------------------------------- tf2onnx (Keras 3)

def tf_models():
    import keras
    import tensorflow as tf
    import tf2onnx

    keras.utils.set_random_seed(0)
    L = keras.layers

    def randomise_bn(model):
        rng = np.random.default_rng(0)
        for layer in model.layers:
            if isinstance(layer, L.BatchNormalization):
                gamma, beta, mean, var = layer.get_weights()
                layer.set_weights([rng.uniform(0.5, 1.5, gamma.shape), rng.uniform(-0.2, 0.2, beta.shape),
                                   rng.uniform(-0.5, 0.5, mean.shape), rng.uniform(0.5, 1.5, var.shape)])
        return model

    classifier = randomise_bn(keras.Sequential([
        keras.Input((16, 16, 3)), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
        L.MaxPooling2D(2), L.Conv2D(16, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
        L.GlobalAveragePooling2D(), L.Dense(16, activation="relu"), L.Dense(5)]))
    segmenter = randomise_bn(keras.Sequential([
        keras.Input((None, None, 3)), L.Conv2D(8, 3, strides=2, padding="same", activation="relu"),
        L.Conv2D(16, 3, padding="same"), L.BatchNormalization(), L.ReLU(), L.UpSampling2D(2),
        L.Conv2D(8, 3, padding="same", activation="relu"), L.Conv2D(1, 1, activation="sigmoid")]))
    recurrent = keras.Sequential([keras.Input((None, 6)), L.LSTM(8), L.Dense(4)])
    models = [
        ("tf_keras_classifier", classifier, (None, 16, 16, 3), [[2, 16, 16, 3], [3, 16, 16, 3]], "cross_entropy"),
        ("tf_keras_segmentation", segmenter, (None, None, None, 3), [[1, 16, 16, 3], [2, 24, 20, 3]], "mse"),
        ("tf_keras_lstm", recurrent, (None, None, 6), [[2, 5, 6], [3, 7, 6]], "cross_entropy"),
    ]
    for key, model, shape, shapes, loss in models:
        spec = (tf.TensorSpec(shape, tf.float32, name="input"),)
        function = tf.function(lambda x, model=model: model(x, training=False), input_signature=spec)
        proto, _ = tf2onnx.convert.from_function(function, input_signature=spec, opset=13)
        (HERE / f"{key}.onnx").write_bytes(proto.SerializeToString())
        record(key, entry(f"{key}.onnx", f"tf2onnx {tf2onnx.__version__} (from_function; tensorflow "
                          f"{tf.__version__}, Keras {keras.__version__}), opset 13",
                          [(proto.graph.input[0].name, "float32", "normal", shapes)], proto.graph.output[0].name,
                          loss=loss))


# --------------------------------------------------------------------------- optimum

def optimum_models():
    import optimum.exporters.onnx as exporters
    import torch
    import transformers as tr

    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    models = [
        ("optimum_bert", "text-classification", tr.AutoModelForSequenceClassification,
         tr.BertConfig(vocab_size=50, max_position_embeddings=32, num_labels=3, **tiny),
         [("input_ids", "int64", "ints:0:50", [[2, 6], [3, 9]]), ("attention_mask", "int64", "ones", [[2, 6], [3, 9]]),
          ("token_type_ids", "int64", "zeros", [[2, 6], [3, 9]])], "cross_entropy"),
        ("optimum_vit", "image-classification", tr.AutoModelForImageClassification,
         tr.ViTConfig(image_size=16, patch_size=8, num_channels=3, num_labels=3, **tiny),
         [("pixel_values", "float32", "normal", [[2, 3, 16, 16], [3, 3, 16, 16]])], "cross_entropy"),
        ("optimum_wav2vec2", "audio-classification", tr.AutoModelForAudioClassification,
         tr.Wav2Vec2Config(vocab_size=12, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_labels=3,
                           num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, classifier_proj_size=8,
                           do_stable_layer_norm=False, feat_extract_norm="group", **tiny),
         [("input_values", "float32", "normal", [[2, 160], [3, 240]])], "cross_entropy"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for key, task, auto, config, inputs, loss in models:
            torch.manual_seed(0)
            auto.from_config(config).eval().save_pretrained(f"{tmp}/{key}")
            exporters.main_export(f"{tmp}/{key}", output=f"{tmp}/{key}-onnx", task=task, do_validation=False)
            (HERE / f"{key}.onnx").write_bytes(Path(f"{tmp}/{key}-onnx/model.onnx").read_bytes())
            import onnx

            model = onnx.load(str(HERE / f"{key}.onnx"))
            names = [i.name for i in model.graph.input]
            record(key, entry(f"{key}.onnx", f"optimum-onnx main_export ({task}; transformers {tr.__version__}, "
                              f"torch {torch.__version__})", [i for i in inputs if i[0] in names],
                              model.graph.output[0].name, loss=loss, optimizer="adam", lr=0.01))


# --------------------------------------------------------------------------- onnx.helper (main env)

def _tensor(rng, name, shape, scale=None):
    from onnx import numpy_helper

    scale = scale if scale is not None else 1.0 / np.sqrt(max(1, int(np.prod(shape[1:]))))
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def silero_like():
    """Silero-VAD-like: ``If`` on the sample rate picks a branch with its own weights as Constant
    nodes (reflect Pad, an STFT-like strided Conv, magnitude, an encoder Conv, an LSTM); both
    branches read one Constant of the main graph (the decoder Conv's weight); Sigmoid, mean over time."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    H = 16

    def const(name, array):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name))

    def branch(tag, frame):
        F = frame // 2 + 1  # STFT-like bins: real and imaginary halves of the conv's output
        nodes = [
            const(f"{tag}_pads", np.array([0, 0, frame // 2, 0, 0, frame // 2], np.int64)),
            helper.make_node("Pad", ["audio", f"{tag}_pads"], [f"{tag}_padded"], mode="reflect"),
            const(f"{tag}_stft_basis", _to_array(_tensor(rng, "b", [2 * F, 1, frame]))),
            helper.make_node("Conv", [f"{tag}_padded", f"{tag}_stft_basis"], [f"{tag}_spec"], strides=[frame // 2]),
            const(f"{tag}_split", np.array([F, F], np.int64)),
            helper.make_node("Split", [f"{tag}_spec", f"{tag}_split"], [f"{tag}_re", f"{tag}_im"], axis=1),
            helper.make_node("Mul", [f"{tag}_re", f"{tag}_re"], [f"{tag}_re2"]),
            helper.make_node("Mul", [f"{tag}_im", f"{tag}_im"], [f"{tag}_im2"]),
            helper.make_node("Add", [f"{tag}_re2", f"{tag}_im2"], [f"{tag}_power"]),
            const(f"{tag}_eps", np.array(1e-3, np.float32)),
            helper.make_node("Add", [f"{tag}_power", f"{tag}_eps"], [f"{tag}_power_eps"]),
            helper.make_node("Sqrt", [f"{tag}_power_eps"], [f"{tag}_mag"]),
            const(f"{tag}_enc_w", _to_array(_tensor(rng, "w", [H, F, 3]))),
            const(f"{tag}_enc_b", _to_array(_tensor(rng, "b", [H], 0.1))),
            helper.make_node("Conv", [f"{tag}_mag", f"{tag}_enc_w", f"{tag}_enc_b"], [f"{tag}_enc"], pads=[1, 1]),
            helper.make_node("Relu", [f"{tag}_enc"], [f"{tag}_enc_relu"]),
            helper.make_node("Transpose", [f"{tag}_enc_relu"], [f"{tag}_seq"], perm=[2, 0, 1]),
            const(f"{tag}_lstm_W", _to_array(_tensor(rng, "W", [1, 4 * H, H]))),
            const(f"{tag}_lstm_R", _to_array(_tensor(rng, "R", [1, 4 * H, H]))),
            const(f"{tag}_lstm_B", _to_array(_tensor(rng, "B", [1, 8 * H], 0.1))),
            helper.make_node("LSTM", [f"{tag}_seq", f"{tag}_lstm_W", f"{tag}_lstm_R", f"{tag}_lstm_B"],
                             [f"{tag}_lstm_Y"], hidden_size=H),
            const(f"{tag}_axis1", np.array([1], np.int64)),
            helper.make_node("Squeeze", [f"{tag}_lstm_Y", f"{tag}_axis1"], [f"{tag}_hidden"]),
            helper.make_node("Transpose", [f"{tag}_hidden"], [f"{tag}_hidden_t"], perm=[1, 2, 0]),
            helper.make_node("Relu", [f"{tag}_hidden_t"], [f"{tag}_hidden_relu"]),
            helper.make_node("Conv", [f"{tag}_hidden_relu", "decoder_w"], [f"{tag}_logit"]),
            helper.make_node("Sigmoid", [f"{tag}_logit"], [f"{tag}_prob"]),
            helper.make_node("ReduceMean", [f"{tag}_prob"], [f"{tag}_out"], axes=[2], keepdims=0),
        ]
        return helper.make_graph(nodes, f"{tag}_branch", [], [
            helper.make_tensor_value_info(f"{tag}_out", TensorProto.FLOAT, None)])

    nodes = [
        helper.make_node("Constant", [], ["decoder_w"],
                         value=numpy_helper.from_array(_to_array(_tensor(rng, "d", [1, H, 1])), "decoder_w")),
        const("sr16k", np.array([16000], np.int64)),
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        const("axis_1", np.array([1], np.int64)),
        helper.make_node("Unsqueeze", ["input", "axis_1"], ["audio"]),
        helper.make_node("If", ["is16k"], ["output"], then_branch=branch("b16k", 32), else_branch=branch("b8k", 16)),
    ]
    graph = helper.make_graph(nodes, "silero_like", [
        helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "samples"]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8,
                             producer_name="onnx.helper")


def _to_array(tensor):
    from onnx import numpy_helper

    return numpy_helper.to_array(tensor)


def old_cnn(opset: int):
    """A tiny CNN in the operator forms of ``opset``: Pad, Conv, BatchNormalization, Relu,
    MaxPool, Upsample (7, 9) or Resize (10+), Conv, Flatten, Gemm. Opset 7 is written as IR 3
    files were (initializers also listed as graph inputs); opset 9 holds its weights in Constant
    nodes, as exporters of that time did; the others in initializers."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(opset)
    weights = [
        _tensor(rng, "conv1_w", [16, 3, 3, 3]), _tensor(rng, "conv1_b", [16], 0.1),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "bn_scale"),
        numpy_helper.from_array(rng.uniform(-0.2, 0.2, 16).astype(np.float32), "bn_bias"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, 16).astype(np.float32), "bn_mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "bn_var"),
        _tensor(rng, "conv2_w", [4, 16, 1, 1]), _tensor(rng, "fc_w", [256, 5]), _tensor(rng, "fc_b", [5], 0.1),
    ]
    nodes, extra = [], []
    if opset < 11:
        nodes.append(helper.make_node("Pad", ["x"], ["padded"], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="constant"))
    else:
        extra.append(numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"))
        nodes.append(helper.make_node("Pad", ["x", "pads"], ["padded"], mode="constant"))
    nodes.append(helper.make_node("Conv", ["padded", "conv1_w", "conv1_b"], ["conv1"], kernel_shape=[3, 3]))
    bn = dict(epsilon=1e-5, spatial=1) if opset < 9 else dict(epsilon=1e-5)
    nodes += [
        helper.make_node("BatchNormalization", ["conv1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn"], **bn),
        helper.make_node("Relu", ["bn"], ["relu1"]),
        helper.make_node("MaxPool", ["relu1"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    scales = np.array([1, 1, 2, 2], np.float32)
    if opset < 9:
        nodes.append(helper.make_node("Upsample", ["pool"], ["up"], scales=scales.tolist(), mode="nearest"))
    elif opset == 9:
        extra.append(numpy_helper.from_array(scales, "scales"))
        nodes.append(helper.make_node("Upsample", ["pool", "scales"], ["up"], mode="nearest"))
    elif opset == 10:
        extra.append(numpy_helper.from_array(scales, "scales"))
        nodes.append(helper.make_node("Resize", ["pool", "scales"], ["up"], mode="nearest"))
    else:
        extra += [numpy_helper.from_array(np.zeros(0, np.float32), "roi"), numpy_helper.from_array(scales, "scales")]
        nodes.append(helper.make_node("Resize", ["pool", "roi", "scales"], ["up"], mode="nearest",
                                      coordinate_transformation_mode="asymmetric", nearest_mode="floor"))
    nodes += [
        helper.make_node("Conv", ["up", "conv2_w"], ["conv2"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["conv2"], ["relu2"]),
        helper.make_node("Flatten", ["relu2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], **({"broadcast": 1} if opset < 7 else {})),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    initializers = weights + extra
    if opset == 9:
        nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in initializers] + nodes
        initializers = []
    if opset < 8:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers]
    graph = helper.make_graph(nodes, f"cnn_opset{opset}", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=3 if opset < 8 else 4 if opset < 11 else 7, producer_name="onnx.helper")


def onnx_models():
    import onnx

    model = silero_like()
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(HERE / "onnx_silero_like.onnx"))
    record("onnx_silero_like", entry(
        "onnx_silero_like.onnx", "onnx.helper (hand-built, silero-VAD-like), opset 16",
        [("input", "float32", "normal", [[1, 256], [1, 400]]), ("sr", "int64", "value:16000", [[1], [1]])], "output",
        note="sr is [1] (silero's is a scalar) so that train's data holds one row per example; the 16 kHz branch runs"))
    for opset in (7, 9, 10, 11, 12):
        model = old_cnn(opset)
        onnx.checker.check_model(model, full_check=True)
        onnx.save(model, str(HERE / f"onnx_cnn_opset{opset}.onnx"))
        record(f"onnx_cnn_opset{opset}", entry(
            f"onnx_cnn_opset{opset}.onnx", f"onnx.helper (hand-built), opset {opset}",
            [("x", "float32", "normal", [[2, 3, 8, 8], [3, 3, 8, 8]])], "logits", loss="cross_entropy"))


def refresh_manifest():
    """Recompute every entry's weights and op multiset from its file (after a rule change)."""
    from catalog import load_manifest

    for key, value in load_manifest().items():
        record(key, {k: v for k, v in value.items() if k not in ("weights", "ops", "opset")})


PRODUCERS = {"torch": torch_models, "paddle": paddle_models, "tf": tf_models, "optimum": optimum_models,
             "onnx": onnx_models,
             "manifest": refresh_manifest}

if __name__ == "__main__":
    for producer in sys.argv[1:] or ["torch", "onnx"]:
        PRODUCERS[producer]()
        print(f"{producer}: done")

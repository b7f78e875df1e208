"""The peer of build_time.py's ``artifacts`` column: onnxruntime-training 1.19.2's ``generate_artifacts``
(AdamW, every float initializer trained, the model's scalar output as the loss), best of ``--repeat``
runs, each writing a fresh directory.

onnxruntime-training is discontinued (its last wheels are for Python 3.11); in a venv of its own:

    python3.11 -m venv /tmp/ortt && /tmp/ortt/bin/pip install onnxruntime-training==1.19.2 "numpy<2" onnx==1.16.2 torch==2.13.0
    /tmp/ortt/bin/python benchmarks/ort_training_build.py MODEL.onnx [--repeat 3]

or let build_time.py run it: ``--ort-training-python /tmp/ortt/bin/python``. Prints the best seconds.
"""
import argparse
import tempfile
import time

import onnx
from onnxruntime.training import artifacts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model")
parser.add_argument("--repeat", type=int, default=3)
args = parser.parse_args()
FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)
best = float("inf")
for _ in range(args.repeat):
    model = onnx.load(args.model)
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)  # onnx 1.16 checks IR versions up to 10
    params = [t.name for t in model.graph.initializer if t.data_type in FLOATS]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        artifacts.generate_artifacts(model, requires_grad=params, loss=None, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=folder)
        best = min(best, time.perf_counter() - start)
print(f"{best:.3f}")

"""HashedDropoutPass: Dropout in training mode draws the mask of the hash of the step and the
micro-batch, fed as uint32 inputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from training.generation.build_models import bn_dropout_model, forward
from helpers import numpy_dropout_mask

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.training.generation.hashed_dropout import DROPOUT_SEEDS, HashedDropoutPass
from onnx_autodiff.training.generation.training_mode import TrainingModePass


def test_masks_are_the_hash_of_step_and_micro_batch():
    proto = bn_dropout_model()
    model, roles = forward(proto)
    mode = TrainingModePass(roles, training=True)(model)
    result = HashedDropoutPass(mode.namer)(model)
    assert list(result.seeds) == list(DROPOUT_SEEDS)
    assert all(v in model.graph.inputs for v in result.seeds.values())
    assert not any(n.op_type == "Dropout" for n in model.graph)
    mask = next(v for n in model.graph for v in n.outputs if v.name.endswith("_mask"))
    model.graph.outputs.append(mask)
    session = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer for name in [t.name]
             if name in {v.name for v in model.graph.inputs}}
    feeds["X"] = np.ones((5, 4), np.float32)
    feeds.update({result.seeds["dropout_step"].name: np.array(7, np.uint32), result.seeds["dropout_micro_batch"].name: np.array(2, np.uint32)})
    drawn = session.run([mask.name], feeds)[0]
    np.testing.assert_array_equal(drawn, numpy_dropout_mask((5, 4), 0.25, step=7, micro_batch=2))


def test_a_model_without_dropout_in_training_mode_is_left_alone():
    model, roles = forward(bn_dropout_model())
    mode = TrainingModePass(roles, training=False)(model)
    result = HashedDropoutPass(mode.namer)(model)
    assert not result.modified and result.seeds == {}
    assert any(n.op_type == "Dropout" for n in model.graph)

"""The generation of training artifacts, as steps over one forward model.

:func:`~.pipeline.build_artifacts` reads the model (:mod:`.source`: lifted Constant weights, a
PyTorch export's parameters recovered, LoRA adapters added) and finds the roles of its initializers
(:mod:`.roles`), then builds each step model (:mod:`.step`) with these passes, each a file:

- :mod:`.training_mode`: layers in training mode, parameters and buffers graph inputs;
- :mod:`.batchnorm_in_standard_ops`, :mod:`.hashed_dropout`: the training mode a target's kernels
  lack (:mod:`~onnx_autodiff.training.targets`);
- :mod:`.loss`: the loss attached;
- :mod:`.differentiate`: the autodiff pass;
- :mod:`.clean_backward`: the cleanup of the backward graph, lowered for the target;
- :mod:`.optimizer_step` or :mod:`.accumulation`: the update, or the gradients summed;
- :mod:`.finish`: the signature set, the optimiser's nodes lowered, :mod:`.frozen_reads`, written once.

The eval model is cut out of the finished train model where it can be (:mod:`.evaluation`), and
the apply model is the optimiser step on the accumulated gradients (:mod:`.apply`). The options
are one :class:`~.config.ArtifactsConfig`.
"""

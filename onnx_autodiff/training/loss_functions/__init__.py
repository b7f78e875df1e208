"""The built-in losses, one module per family: each loss a function registered by name
(:func:`~.base.register_loss`). Importing this package registers them, in the order ``LOSSES``
and the command line list them; another built-in loss is a module of its own that registers its
function, named here, and a user's own is registered the same way from their code."""

from onnx_autodiff.training.loss_functions import classes, elementwise, causal_lm, ctc  # noqa: F401  (registers them, in this order)
